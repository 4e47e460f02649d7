#!/usr/bin/env bash
# HLE (free-form; LLM judge): generate K=1 samples per question against a running OpenAI-compatible server, then grade them.
#   eval/hle/run.sh [DATA [BASE_URL]]   (arguments win over the environment; see eval/run_benchmark.sh, eval/README.md)
set -euo pipefail
exec "$(dirname "$0")/../run_benchmark.sh" hle eval/data/hle.jsonl 1 llm "$@"
