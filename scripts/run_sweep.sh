#!/usr/bin/env bash
# Steady-state engine sweep in DeepInfer's positional form; a thin wrapper over `dsinfer bench sweep`.
#
#   scripts/run_sweep.sh MODE TAG [CONTEXT] [NEXTN] [ACCEPT] [-- EXTRA FLAGS...]
#   scripts/run_sweep.sh decode  ce-128k 131072 3 0.75    # requests per DP rank; nextn=3, 75% acceptance
#   scripts/run_sweep.sh prefill pe-128k 131072           # batch tokens per step
#   scripts/run_sweep.sh encoder ve-800 [IMAGE_SIZE]      # images per batch through the V4.1 image encoder
#   FLASH_LAYERS=3 DEVICE=cuda POINTS=1,8,32 scripts/run_sweep.sh decode flash3-8k 8192
#
# With no MODEL, CONFIG or FLASH_LAYERS and a CUDA device, decode and prefill run what DeepInfer's command runs:
# V4.1-Flash widths (FLASH_LAYERS=4 ARCH=v41, random weights in release precision, Engram tables in host shared
# memory), DeepInfer's points overlaid on the chart with the full-depth estimate beside them, and (decode, NEXTN
# > 0) DSpark drafting NEXTN tokens a step, every step verifying 1 + NEXTN tokens per sequence as DeepInfer's do
# (SPECULATIVE_CONFIG=none: no drafts, only the assumed accounting). Without CUDA the tiny checkpoint runs.
#
# MODE is decode, prefill or encoder. The encoder mode's third positional is the square image side (default
# 800); it reads VISION_WIDTH=flash|tiny (default: flash on CUDA) or CONFIG, DEVICE, DTYPE, POINTS (default
# 1,2,4,...,64), OUT_ROOT, WARMUP_STEPS, MEASURE_STEPS and SEED, and builds random weights on the device.
# Everything else comes from the environment; unset means the `dsinfer bench sweep` default:
#   MODEL=DIR            checkpoint directory          CONFIG=config.json   random weights of that shape
#   FLASH_LAYERS=N       random weights, V4-Flash widths, N layers (no model option: the tiny checkpoint)
#   DEVICE=cuda|cpu      DTYPE=bfloat16|float32        POINTS=1,2,4,...     OUT_ROOT=sweeps
#   WARMUP_STEPS=3       MEASURE_STEPS=10              CACHE_GIB=G          PREFILL_CHUNK=8192
#   TELEMETRY_INTERVAL=5 (seconds; 0 = off)            SEED=0               PYTHON=python3
#   COMPARE_PUBLISHED=1  overlay DeepInfer's B200 points on the chart
#   ARCH=v4|v41          widths of FLASH_LAYERS        ENGRAM_GIB=G         V4.1 host Engram tables (default 8)
#   V41_PREFILL=bounded|exact                          SPECULATIVE_CONFIG=JSON (e.g. {"method": "dspark", ...})
# Only dp_rank 0 (DP_RANK, else RANK) writes; other ranks run the points and exit. PROFILE is forced to 0:
# a profiler distorts steady state.
#
# Writes OUT_ROOT/TAG/results.jsonl (one JSON object per point), pareto.png, summary.json and, on CUDA
# with NVML, telemetry.csv. Fields of a results.jsonl record (the full table: `pydoc dsinfer.bench.sweep`):
#   mode, point, point_unit, context, tag
#   ms_per_step (mean of the timed steps), median_/min_/max_/p90_ms_per_step, steps, warmup_steps, measured_s
#   tokens_per_step, tokens_per_s_per_gpu (= tokens_per_step / s per step), throughput_kind
#   tokens_per_step_per_user, tokens_per_s_per_user (decode), irregular_steps, preemptions, step_time_share
#   decode: context_range, fill_steps, fill_s, nextn, accept, speculative, measured {...}, assumed {...}
#     assumed.tokens_per_step_per_user = 1 + nextn * accept (tau, 3.25 for 3 / 0.75) on the measured step;
#     measured = what ran (1 token/step: speculative decoding is "not implemented, measured = no drafts")
#   prefill: requests, position_cycle_steps, covers_full_cycle
#   model, model_source, weights, num_layers, hidden_size, n_routed_experts, vocab_size
#   dtype, device, gpu_name, engine {EngineConfig}, sampling, dp_rank, world_size, seed, timestamp,
#   dsinfer_version, torch_version
set -euo pipefail

usage() {
  echo "usage: $0 decode|prefill|encoder TAG [CONTEXT | IMAGE_SIZE] [NEXTN] [ACCEPT] [-- EXTRA FLAGS...]" >&2
  exit 2
}
[[ $# -ge 2 ]] || usage
MODE=$1 TAG=$2
shift 2
POSITIONAL=()
while [[ $# -gt 0 && $1 != "--" && ${#POSITIONAL[@]} -lt 3 ]]; do POSITIONAL+=("$1"); shift; done
[[ ${1:-} == "--" ]] && shift
CONTEXT=${POSITIONAL[0]:-} NEXTN=${POSITIONAL[1]:-} ACCEPT=${POSITIONAL[2]:-}
case $MODE in
  decode | prefill) ;;
  encoder)
    export PROFILE=0
    args=(bench sweep encoder --tag "$TAG" --image-size "${CONTEXT:-800}")
    for pair in "--vision-width:${VISION_WIDTH:-}" "--config:${CONFIG:-}" "--device:${DEVICE:-}" \
                "--dtype:${DTYPE:-}" "--points:${POINTS:-}" "--out-root:${OUT_ROOT:-}" \
                "--warmup-steps:${WARMUP_STEPS:-}" "--measure-steps:${MEASURE_STEPS:-}" "--seed:${SEED:-}"; do
      [[ -n ${pair#*:} ]] && args+=("${pair%%:*}" "${pair#*:}")
    done
    exec "${PYTHON:-$(command -v python || command -v python3)}" -m dsinfer.cli "${args[@]}" "$@"
    ;;
  *) echo "$0: MODE must be decode, prefill or encoder, got '$MODE'" >&2; usage ;;
esac
if [[ $MODE == prefill && -n $NEXTN && $NEXTN != 0 ]]; then
  echo "$0: NEXTN applies to decode sweeps only" >&2
  exit 2
fi

if [[ -z ${PYTHON:-} ]]; then
  PYTHON=$(command -v python || command -v python3)
fi
if [[ -z ${MODEL:-}${CONFIG:-}${FLASH_LAYERS:-} && ${DEVICE:-cuda} == cuda* ]] \
  && "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  FLASH_LAYERS=4 ARCH=${ARCH:-v41} COMPARE_PUBLISHED=${COMPARE_PUBLISHED:-1}
  if [[ $MODE == decode && ${NEXTN:-0} != 0 && -z ${SPECULATIVE_CONFIG:-} ]]; then
    SPECULATIVE_CONFIG="{\"method\": \"dspark\", \"num_speculative_tokens\": $NEXTN}"
  fi
fi
[[ ${SPECULATIVE_CONFIG:-} == none ]] && SPECULATIVE_CONFIG=

export PROFILE=0
args=(bench sweep "$MODE" --tag "$TAG")
add() { [[ -n ${2:-} ]] && args+=("$1" "$2"); return 0; }
add --context "$CONTEXT"
[[ $MODE == decode ]] && add --nextn "$NEXTN" && add --accept "$ACCEPT"
add --model "${MODEL:-}"
add --config "${CONFIG:-}"
add --flash-layers "${FLASH_LAYERS:-}"
add --device "${DEVICE:-}"
add --dtype "${DTYPE:-}"
add --points "${POINTS:-}"
add --out-root "${OUT_ROOT:-}"
add --warmup-steps "${WARMUP_STEPS:-}"
add --measure-steps "${MEASURE_STEPS:-}"
add --cache-gib "${CACHE_GIB:-}"
add --prefill-chunk "${PREFILL_CHUNK:-}"
add --telemetry-interval "${TELEMETRY_INTERVAL:-}"
add --seed "${SEED:-}"
add --arch "${ARCH:-}"
add --engram-gib "${ENGRAM_GIB:-}"
add --v41-prefill "${V41_PREFILL:-}"
[[ $MODE == decode ]] && add --speculative-config "${SPECULATIVE_CONFIG:-}"
[[ ${COMPARE_PUBLISHED:-0} != 0 ]] && args+=(--compare-published)

exec "$PYTHON" -m dsinfer.cli "${args[@]}" "$@"
