#!/usr/bin/env bash
# AIME (integer answers): generate K=32 samples per question against a running OpenAI-compatible server, then grade them.
#   eval/aime/run.sh [DATA [BASE_URL]]   (arguments win over the environment; see eval/run_benchmark.sh, eval/README.md)
set -euo pipefail
exec "$(dirname "$0")/../run_benchmark.sh" aime eval/data/aime2026.jsonl 32 rule "$@"
