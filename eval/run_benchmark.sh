#!/usr/bin/env bash
# Shared body of eval/{aime,gpqa,hle}/run.sh: generate K samples per question against a running
# OpenAI-compatible server, then grade them.
#   eval/run_benchmark.sh BENCH DEFAULT_DATA DEFAULT_K DEFAULT_JUDGE [DATA [BASE_URL]]
# Environment: DATA, BASE_URL, MODEL, OUT, K, TEMPERATURE, TOP_P, MAX_TOKENS, REASONING_EFFORT, CONCURRENCY, SEED,
#   JUDGE, JUDGE_BASE_URL, JUDGE_MODEL. Rerunning the same command resumes generation where it stopped.
set -euo pipefail

BENCH="$1" DEFAULT_DATA="$2" DEFAULT_K="$3" DEFAULT_JUDGE="$4"
shift 4
DATA="${1:-${DATA:-$DEFAULT_DATA}}"
BASE_URL="${2:-${BASE_URL:-http://127.0.0.1:8000}}"
OUT="${OUT:-eval/results/$BENCH}"
JUDGE="${JUDGE:-$DEFAULT_JUDGE}"

if [ "$JUDGE" = llm ] && [ -z "${JUDGE_BASE_URL:-${DSINFER_JUDGE_BASE_URL:-}}" ]; then
  echo "eval/$BENCH/run.sh: the llm judge needs an endpoint: set JUDGE_BASE_URL (and JUDGE_MODEL)" >&2
  exit 2
fi

status=0
dsinfer eval run "$BENCH" --data "$DATA" --base-url "$BASE_URL" ${MODEL:+--model "$MODEL"} --out "$OUT" \
  --samples "${K:-$DEFAULT_K}" --temperature "${TEMPERATURE:-1.0}" --top-p "${TOP_P:-1.0}" \
  --max-tokens "${MAX_TOKENS:-32768}" --reasoning-effort "${REASONING_EFFORT:-high}" \
  --concurrency "${CONCURRENCY:-32}" --seed "${SEED:-0}" || status=$?
# 3 = every sample was attempted but some failed: grade anyway (coverage_complete will say false), then fail.
if [ "$status" -ne 0 ] && [ "$status" -ne 3 ]; then exit "$status"; fi

dsinfer eval grade "$OUT" --judge "$JUDGE" ${JUDGE_BASE_URL:+--judge-base-url "$JUDGE_BASE_URL"} \
  ${JUDGE_MODEL:+--judge-model "$JUDGE_MODEL"}
exit "$status"
