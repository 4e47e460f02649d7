#!/usr/bin/env bash
# GPQA (multiple choice): generate K=8 samples per question against a running OpenAI-compatible server, then grade them.
#   eval/gpqa/run.sh [DATA [BASE_URL]]   (arguments win over the environment; see eval/run_benchmark.sh, eval/README.md)
set -euo pipefail
exec "$(dirname "$0")/../run_benchmark.sh" gpqa eval/data/gpqa_diamond.jsonl 8 rule "$@"
