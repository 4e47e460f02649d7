#!/usr/bin/env bash
# HLE (free-form; LLM judge): generate K=1 samples per question
#   against a running OpenAI-compatible server, then grade them.
#   eval/hle/run.sh [DATA [BASE_URL]]            (arguments win over the environment; see eval/README.md)
# Environment: DATA, BASE_URL, MODEL, OUT, K, TEMPERATURE, TOP_P, MAX_TOKENS, REASONING_EFFORT, CONCURRENCY, SEED,
#   JUDGE, JUDGE_BASE_URL, JUDGE_MODEL. Rerunning the same command resumes generation where it stopped.
set -euo pipefail

DATA="${1:-${DATA:-eval/data/hle.jsonl}}"
BASE_URL="${2:-${BASE_URL:-http://127.0.0.1:8000}}"
OUT="${OUT:-eval/results/hle}"
JUDGE="${JUDGE:-llm}"

if [ "$JUDGE" = llm ] && [ -z "${JUDGE_BASE_URL:-${DSINFER_JUDGE_BASE_URL:-}}" ]; then
  echo "eval/hle/run.sh: the llm judge needs an endpoint: set JUDGE_BASE_URL (and JUDGE_MODEL)" >&2
  exit 2
fi

status=0
dsinfer eval run hle --data "$DATA" --base-url "$BASE_URL" ${MODEL:+--model "$MODEL"} --out "$OUT" \
  --samples "${K:-1}" --temperature "${TEMPERATURE:-1.0}" --top-p "${TOP_P:-1.0}" \
  --max-tokens "${MAX_TOKENS:-32768}" --reasoning-effort "${REASONING_EFFORT:-high}" \
  --concurrency "${CONCURRENCY:-32}" --seed "${SEED:-0}" || status=$?
# 3 = every sample was attempted but some failed: grade anyway (coverage_complete will say false), then fail.
if [ "$status" -ne 0 ] && [ "$status" -ne 3 ]; then exit "$status"; fi

dsinfer eval grade "$OUT" --judge "$JUDGE" ${JUDGE_BASE_URL:+--judge-base-url "$JUDGE_BASE_URL"} \
  ${JUDGE_MODEL:+--judge-model "$JUDGE_MODEL"}
exit "$status"
