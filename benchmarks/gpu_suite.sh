#!/usr/bin/env bash
# The GPU checks and timings behind docs/perf.md, run in one go on one machine (stages chosen by name).
#
#   OUT=results bash benchmarks/gpu_suite.sh ops fast v41 ep            # each stage's log under $OUT
#
# Stages: ops (tests/ops on the GPU), peer (HF transformers, ../shared/bench or PEER=path), fast
# (benchmarks/fast_path_checks.py with kernel profiles), v41 (V4.1 decode graphs), ep (EP = 1 overhead),
# sweep (engine decode sweep, graphs and eager), spec (MTP verify steps), engine (greedy tokens CUDA vs CPU).
# Each stage runs under its own time limit (LIMIT_<stage>, else STAGE_SECONDS, default 150 s) so one hang cannot
# eat the rest.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_suite_results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
LIMIT=${STAGE_SECONDS:-150}
SLICE="--flash-layers 4 --context 256 --points 1,32 --measure-steps 10 --cache-gib 16"

stage() {  # stage NAME COMMAND...: run with the limit, keep the log, say how it ended
    local name=$1; shift
    local start=$SECONDS limit_name="LIMIT_$name"
    echo "=== $name: $*"
    timeout "${!limit_name:-$LIMIT}" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    tail -n "${TAIL_LINES:-15}" "$OUT/$name.log"
}

for name in "$@"; do
    case $name in
        ops) stage ops python3 -m pytest tests/ops -q -k "not interpret" -p no:cacheprovider ;;
        peer) LAYERS=4 stage peer python3 "${PEER:-../shared/bench/hf_v4_peer.py}" ;;
        fast) stage fast python3 benchmarks/fast_path_checks.py --layers 4 --decode-batches 1 32 \
                  --long-decode 256:4096 --prefill-tokens 4096 16384 --profile --out "$OUT/fast.json" ;;
        v41) stage v41 python3 benchmarks/v41_decode_checks.py --experts 384 --batches 1 32 --context 256 ;;
        ep) stage ep python3 benchmarks/ep_overhead.py --flash-layers 4 --device cuda --dtype bfloat16 \
                --batches 1,16,64 --context 1024 --rounds 3 --steps 20 --cache-gib 4 \
                --modes single,single-eager,ep1-graph,ep1-graph-local ;;
        sweep) stage sweep python3 -m dsinfer.cli bench sweep decode $SLICE --tag graphs ;;
        spec) stage spec python3 -m dsinfer.cli bench sweep decode $SLICE --tag spec-k3 \
                  --speculative-config '{"method": "mtp", "num_speculative_tokens": 3}' ;;
        engine) stage engine python3 benchmarks/cuda_engine_check.py ;;
        *) echo "unknown stage: $name" >&2; exit 2 ;;
    esac
done
