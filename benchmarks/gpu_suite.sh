#!/usr/bin/env bash
# The GPU checks and timings behind docs/perf.md, run in one go on one machine (stages chosen by name).
#
#   OUT=results bash benchmarks/gpu_suite.sh ops fast v41 ep            # each stage's log under $OUT
#
# Stages: ops (tests/ops and the engine's CUDA-against-CPU test on the GPU, over 8 pytest-xdist workers where it is
# installed), peer (HF transformers, ../shared/bench or PEER=path), fast (benchmarks/fast_path_checks.py with kernel
# profiles), v41 (V4.1 decode graphs), ep (EP = 1 overhead), sweep (engine decode sweep), spec (MTP verify steps, K =
# 1..5 or SPEC_K), speedup (DSpark K = 3 on the trained default, 1 and 16 streams; SPEEDUP_PROFILE_CHATS profiles),
# prefill (engine prefill sweep with GPU telemetry), engine (greedy tokens CUDA vs CPU, and the slice's fast path vs its
# reference path), long (engine decode of 16 requests at 8k context), serve (`dsinfer serve` on the slice under `dsinfer
# bench serve`: 16 streams, 8k in, 1k out; SERVE_* change it), gemv (every launch of the one-token FP8 GEMV with no
# weight in L2, GEMV_MODEL=v4|v41), rounding (the tiny V4.1 with its rounding on, fast path vs the reference path on
# CUDA, ROUNDING_PROMPTS prompts), stepprofile (the engine's decode step at PROFILE_POINT requests, then PROFILE_STEPS
# steps profiled: its kernels, copies and gaps), seed (engine decode at 131,072 tokens, 1 to 256 requests, V4 and V4.1
# slices), seedprefill (prefill at 131,072 and 16,384 tokens, V4, V4.1 bounded and exact; PREFILL_PROFILE_STEPS
# profiles V4's steps), firstprompt (the first long prompt after start-up against the second), verify (speculative
# verify steps against the plain step, benchmarks/spec_verify_step.py; VERIFY_CONTEXTS, VERIFY_REQUESTS,
# VERIFY_PROFILE_STEPS), offload (benchmarks/expert_offload.py), servespec
# (the serve stage on a slice with an MTP layer, MTP K = 3 drafts then none: 16 prompts of 8k in, 256 out), fulldepth
# (full-depth V4-Flash of random weights behind `dsinfer serve --expert-offload auto`, 1 and 8 streams), kvdtype (V4
# decode at 131,072 tokens, 64 and 256 requests, index keys bf16 then fp8), fp4words (the FP4 words scores kernels at
# other pipelining, WORDS_LAUNCHES "STAGES:WARPS[:PROGRAMS] ..." for the Triton one, MMA_LAUNCHES
# "STAGES:REGISTERS[:PROGRAMS] ..." for the Gluon one), topk (the indexer's top-k selection at
# long-context shapes, benchmarks/index_topk.py), prefillattn (the prefill attention op of 8,192 tokens at
# 131,072 and 16,384 context, CSA and HCA, against its reference; PREFILL_ATTN_CONFIGS "H:N:W:S ..." sweeps
# launches instead), prefillscores (the indexer's prefill scores of 8,192 queries at 131,072 context, V4's 64 heads
# over ratio-4 entries then V4.1's encoder, 32 heads over ratio-2 entries, each launch of SCORES_CONFIGS
# "T:W:WARPS:STAGES[:REGISTERS[:KERNEL]] ..." against the reference, KERNEL gluon the Hopper one). FP8_LINEARS=keep
# runs the fast stage with the FP8 linears kept as stored. SWEEP_STEPS (200) sets the steps the sweep and spec
# stages time.
# Each stage runs under its own time limit (LIMIT_<stage>, else STAGE_SECONDS, default 150 s; serve, servespec,
# serveplain, speedup and engine default to 300 s: the slice's server takes ~80 s to start, more than 125 s with MTP
# drafts on a machine whose compile caches are cold, the speedup stage compiled past 150 s there, and the engine
# check runs three models) so one hang cannot eat the rest.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_suite_results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
LIMIT=${STAGE_SECONDS:-150}
: "${LIMIT_serve:=300}" "${LIMIT_servespec:=300}" "${LIMIT_serveplain:=300}" "${LIMIT_speedup:=300}"
: "${LIMIT_engine:=300}"
# With ten or fifty timed steps a few slow host steps still pulled the 1-request mean well above its median
# (docs/perf.md, history, passes 12 and 13), hence 200.
# The sweep as `dsinfer bench sweep` runs it, without the CLI's server imports (a GPU image may lack them).
SWEEP="python3 -m dsinfer.bench.sweep"
LONG="--flash-layers 4 --context 131072 --points 1,8,64,256 --measure-steps 30 --profile-steps 1 --telemetry-interval 0"
# Prefill points time whole position cycles (the sweep rounds the timed steps up) after 8 warm-up steps.
PREFILL_SEED="--flash-layers 4 --warmup-steps 8 --telemetry-interval 0"
SLICE="--flash-layers 4 --context 256 --points 1,32 --measure-steps ${SWEEP_STEPS:-200} --cache-gib 16"

stage() {  # stage NAME COMMAND...: run with the limit, keep the log, say how it ended
    local name=$1; shift
    local start=$SECONDS limit_name="LIMIT_$name"
    echo "=== $name: $*"
    timeout "${!limit_name:-$LIMIT}" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    tail -n "${TAIL_LINES:-15}" "$OUT/$name.log"
}

serve_run() {  # the slice (random weights) behind `dsinfer serve`, loaded by `dsinfer bench serve`
    local model=${SERVE_MODEL:-} port=${SERVE_PORT:-8123} ready=0
    if [ -z "$model" ]; then
        model=$(mktemp -d)/slice
        python3 -m dsinfer.cli make-slice "$model" --flash-layers "${SERVE_LAYERS:-4}" --nextn "${SERVE_NEXTN:-0}" \
            || return 1
    fi
    python3 -m dsinfer.cli serve "$model" --load-format dummy --device "${SERVE_DEVICE:-cuda}" \
        --dtype "${SERVE_DTYPE:-bfloat16}" --port "$port" --served-model-name slice --max-num-seqs "${SERVE_SEQS:-16}" \
        --max-model-len $((${SERVE_INPUT:-8192} + ${SERVE_OUTPUT:-1024} + 64)) ${SERVE_ARGS:-} >"$OUT/server.log" 2>&1 &
    local server=$!
    for _ in $(seq 1 "${SERVE_WAIT:-240}"); do
        if python3 -c "import httpx,sys; sys.exit(httpx.get('http://127.0.0.1:$port/health').status_code != 200)" \
            2>/dev/null; then ready=1; break; fi
        kill -0 $server 2>/dev/null || break
        sleep 1
    done
    local long=sweeps/long/results.jsonl  # the `long` stage's offline step at the same batch, unless given
    if [ -z "${SERVE_OFFLINE_STEP_MS:-}" ] && [ -f $long ]; then
        SERVE_OFFLINE_STEP_MS=$(python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])['ms_per_step'])" $long)
    fi
    if [ $ready = 1 ]; then
        for streams in ${SERVE_CONCURRENCY:-16}; do  # one server, one bench run per concurrency
            local tag=${SERVE_TAG:-serve}${SERVE_TAG_STREAMS:+-$streams}
            python3 -m dsinfer.cli bench serve --base-url "http://127.0.0.1:$port" --model slice --dataset random \
                --input-len "${SERVE_INPUT:-8192}" --output-len "${SERVE_OUTPUT:-1024}" \
                --num-prompts "${SERVE_PROMPTS:-$((streams * 2))}" --max-concurrency "$streams" --seed 0 \
                --disable-tqdm --out "$OUT/$tag.json" ${SERVE_OFFLINE_STEP_MS:+--offline-step-ms "$SERVE_OFFLINE_STEP_MS"}
            python3 -c "import httpx; print(httpx.get('http://127.0.0.1:$port/metrics').text)" >"$OUT/$tag.metrics" 2>&1
        done
    else
        echo "the server did not answer /health"; tail -n 30 "$OUT/server.log"
    fi
    local rc=$?
    kill -TERM $server 2>/dev/null
    wait $server
    return $rc
}

spec_sweeps() {  # decode step time on the slice: plain, then MTP drafts of each K (verify steps)
    $SWEEP decode $SLICE --tag plain || return 1
    for k in ${SPEC_K:-1 2 3 4 5}; do
        $SWEEP decode $SLICE --tag "mtp-k$k" \
            --speculative-config "{\"method\": \"mtp\", \"num_speculative_tokens\": $k}" || return 1
    done
}

for name in "$@"; do
    case $name in
        ops) workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${OPS_WORKERS:-8}" || echo "-o addopts=")  # xdist if there
             stage ops python3 -m pytest tests/ops tests/test_cuda_engine.py -q -k "not interpret" -p no:cacheprovider $workers ;;
        peer) LAYERS=4 stage peer python3 "${PEER:-../shared/bench/hf_v4_peer.py}" ;;
        fast) stage fast python3 benchmarks/fast_path_checks.py --layers 4 --decode-batches 1 32 \
                  --long-decode 256:4096 --prefill-tokens 4096 16384 --profile --profile-top "${PROFILE_TOP:-25}" \
                  --fp8-linears "${FP8_LINEARS:-dequantize}" --out "$OUT/fast.json" ;;
        v41) stage v41 python3 benchmarks/v41_decode_checks.py --experts 384 --batches 1 32 --context 256 \
                 --profile "${PROFILE_TOP:-25}" --out "$OUT/v41.json" ;;
        ep) stage ep python3 benchmarks/ep_overhead.py --flash-layers 4 --device cuda --dtype bfloat16 \
                --batches 1,16,64 --context 1024 --rounds 3 --steps 20 --cache-gib 4 \
                --modes single,single-eager,ep1-graph,ep1-graph-local ;;
        sweep) stage sweep $SWEEP decode $SLICE --tag graphs ;;
        stepprofile) stage stepprofile $SWEEP decode --flash-layers 4 --context 256 \
                         --points "${PROFILE_POINT:-1}" --measure-steps "${SWEEP_STEPS:-200}" --cache-gib 16 \
                         --profile-steps "${PROFILE_STEPS:-10}" --tag stepprofile ;;  # its own process: see step_profile
        spec) export -f spec_sweeps; export SLICE; stage spec bash -c spec_sweeps ;;
        speedup) stage speedup python3 benchmarks/spec_speedup.py --device cuda --streams ${SPEEDUP_STREAMS:-1 16} \
                     --modes plain dspark:3 --chats 2 --max-tokens 128 --rounds "${SPEEDUP_ROUNDS:-2}" \
                     --profile-chats "${SPEEDUP_PROFILE_CHATS:-0}" --out "$OUT/speedup.json" ;;
        prefill) stage prefill $SWEEP prefill --flash-layers 4 --context 16384 \
                     --points 4096,16384 --cache-gib 16 --telemetry-interval 0.25 --warmup-steps "${PREFILL_WARMUP:-8}" \
                     --measure-steps "${PREFILL_STEPS:-48}" --tag prefill ;;
        engine) stage engine python3 benchmarks/cuda_engine_check.py --slice-layers 4 ${ENGINE_ARGS:-} ;;
        long) stage long $SWEEP decode --flash-layers 4 --context 8192 --points 16 \
                  --measure-steps 20 --cache-gib 16 --tag long ;;
        serve) export -f serve_run; export OUT; stage serve bash -c serve_run ;;
        servespec) export -f serve_run; export OUT  # the slice served with MTP K = 3 drafts, then without
                   SERVE_TAG=serve-mtp3 SERVE_NEXTN=1 SERVE_PROMPTS=${SERVE_PROMPTS:-16} \
                       SERVE_OUTPUT=${SERVE_OUTPUT:-256} \
                       SERVE_ARGS="--speculative-config {\"method\":\"mtp\",\"num_speculative_tokens\":3}" \
                       stage servespec bash -c serve_run
                   SERVE_TAG=serve-plain SERVE_NEXTN=1 SERVE_PROMPTS=${SERVE_PROMPTS:-16} \
                       SERVE_OUTPUT=${SERVE_OUTPUT:-256} \
                       stage serveplain bash -c serve_run ;;
        fulldepth) export -f serve_run; export OUT  # full-depth V4-Flash, random experts, --expert-offload auto
                   SERVE_TAG=fulldepth SERVE_TAG_STREAMS=1 SERVE_LAYERS=43 SERVE_SEQS=8 \
                       SERVE_CONCURRENCY="${FULLDEPTH_STREAMS:-1 8}" SERVE_OUTPUT=256 SERVE_WAIT=420 \
                       SERVE_ARGS="--expert-offload auto" LIMIT_fulldepth=${LIMIT_fulldepth:-540} \
                       stage fulldepth bash -c serve_run ;;
        gemv) stage gemv python3 benchmarks/fp8_linear_choice.py --sweep --gemv-only --tokens 1 --cold --top 0 \
                  --model "${GEMV_MODEL:-v4}" ;;
        rounding) stage rounding python3 benchmarks/cuda_engine_check.py --rounding-only \
                      --prompts "${ROUNDING_PROMPTS:-96}" ;;
        seed) stage seed bash -c "$SWEEP decode $LONG --prefill-chunk 32768 --tag v4-d131k && \
                  $SWEEP decode $LONG --arch v41 --engram-gib 4 --prefill-chunk 16384 --compare-published --tag v41-d131k" ;;
        seedprefill) stage seedprefill bash -c "for ctx in 131072 16384; do \
                  $SWEEP prefill $PREFILL_SEED --context \$ctx --points 8192,32768 \
                      --profile-steps ${PREFILL_PROFILE_STEPS:-0} --tag v4-p\$ctx && \
                  $SWEEP prefill $PREFILL_SEED --arch v41 --engram-gib 4 --context \$ctx --points 8192,32768 \
                      --compare-published --tag v41-p\$ctx && \
                  $SWEEP prefill $PREFILL_SEED --arch v41 --engram-gib 4 --v41-prefill exact --context \$ctx \
                      --points 8192,32768 --tag v41x-p\$ctx; done" ;;
        firstprompt) stage firstprompt bash -c "python3 benchmarks/first_long_prompt.py --flash-layers 4 \
                  --context 131072 && python3 benchmarks/first_long_prompt.py --flash-layers 4 --arch v41 \
                  --engram-gib 4 --context 131072" ;;
        verify) stage verify bash -c "for arch in v4 v41; do python3 benchmarks/spec_verify_step.py --device cuda \
                    --arch \$arch --contexts ${VERIFY_CONTEXTS:-256} --requests ${VERIFY_REQUESTS:-1,32,64} \
                    --profile-steps ${VERIFY_PROFILE_STEPS:-0} --out $OUT/verify-\$arch.json || exit 1; done" ;;
        offload) stage offload python3 benchmarks/expert_offload.py --out "$OUT/expert_offload.json" ;;
        kvdtype) stage kvdtype bash -c "for dtype in bf16 fp8; do $SWEEP decode --flash-layers 4 --context 131072 \
                     --points 64,256 --prefill-chunk 32768 --telemetry-interval 0 --kv-cache-dtype \$dtype \
                     --tag v4-d131k-\$dtype || exit 1; done" ;;
        fp4words) stage fp4words python3 benchmarks/indexer_decode.py --keys fp4 --context 131072 --batch 64 256 \
                      --fp4-layouts words words_mma --words-launches ${WORDS_LAUNCHES:-3:4:4 5:4:8} \
                      --mma-launches ${MMA_LAUNCHES:-4:96 6:96 5:0} ;;
        topk) stage topk python3 benchmarks/index_topk.py ;;
        prefillattn) stage prefillattn bash -c "for start in 122880 8192; do python3 benchmarks/attention_prefill.py \
                         --tokens 8192 --start \$start --layers hca csa \
                         ${PREFILL_ATTN_CONFIGS:+--sweep --configs $PREFILL_ATTN_CONFIGS} || exit 1; done" ;;
        prefillscores) scores_configs=${SCORES_CONFIGS:-64:128:8:3 64:128:8:3:128 64:256:8:3:0:gluon 64:128:4:3:0:gluon}
                       stage prefillscores bash -c "python3 benchmarks/indexer_prefill.py --sweep --tokens 8192 \
                           --start 122880 --configs $scores_configs && \
                           python3 benchmarks/indexer_prefill.py --sweep --tokens 8192 --start 122880 --heads 32 \
                           --ratio 2 --configs $scores_configs" ;;
        *) echo "unknown stage: $name" >&2; exit 2 ;;
    esac
done
