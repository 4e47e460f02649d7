"""``dsinfer eval run BENCHMARK ...`` (generation) and ``dsinfer eval grade DIR ...`` (judging); see eval/README.md."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dsinfer import envs
from dsinfer.arg_types import positive_int
from dsinfer.eval.backends import REASONING_EFFORTS, GenerationOptions, OfflineBackend, OpenAIBackend
from dsinfer.eval.datasets import BENCHMARKS, DEFAULT_SAMPLES, EvalError, load_dataset
from dsinfer.eval.generate import GenerationRun, read_manifest, run_generation
from dsinfer.eval.grade import DEFAULT_JUDGE, JUDGES, grade_run

#: Exit status of ``run`` when every sample was attempted but some failed (rerun to retry them).
EXIT_SAMPLES_FAILED = 3


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def _top_p(text: str) -> float:
    value = _non_negative_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def run_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsinfer eval run", description="generate answers (resumable)")
    parser.add_argument("benchmark", choices=BENCHMARKS)
    parser.add_argument("--data", required=True, help="the benchmark's JSONL file (format: eval/README.md)")
    parser.add_argument("--out", required=True, help="run directory: run.json, generations.jsonl")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (dsinfer serve)")
    source.add_argument("--model-dir", help="generate in this process with dsinfer's engine from this checkpoint")
    parser.add_argument("--model", help="model name for --base-url (default: the one model the server lists)")
    parser.add_argument("--api-key", default=None, help="API key (default: $OPENAI_API_KEY, else none)")
    parser.add_argument("--samples", type=positive_int, default=None,
                        help="samples per question (default: AIME 32, GPQA 8, HLE 1)")  # fmt: skip
    parser.add_argument("--temperature", type=_non_negative_float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=_top_p, default=1.0)
    parser.add_argument("--reasoning-effort", choices=REASONING_EFFORTS, default="high",
                        help="thinking effort; 'none' turns thinking mode off")  # fmt: skip
    parser.add_argument("--max-tokens", type=positive_int, default=32768, help="new tokens per sample")
    parser.add_argument("--concurrency", type=positive_int, default=16, help="requests in flight")
    parser.add_argument("--seed", type=int, default=0, help="run seed: per-sample seeds and GPQA option order")
    parser.add_argument("--limit", type=positive_int, default=None, help="only the first N questions")
    parser.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request (--base-url)")
    parser.add_argument("--max-retries", type=int, default=3, help="retries of a failed request (--base-url)")
    parser.add_argument("--device", default=None, help="--model-dir: cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="--model-dir: weights dtype (default: bfloat16 on CUDA, float32 on CPU)")  # fmt: skip
    parser.add_argument("--max-model-len", type=positive_int, default=None, help="--model-dir only")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def grade_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsinfer eval grade", description="judge saved generations")
    parser.add_argument("directory", help="a run directory written by 'dsinfer eval run'")
    parser.add_argument("--judge", choices=JUDGES, default=None,
                        help="rule (AIME, GPQA) or llm; default: rule for AIME and GPQA, llm for HLE")  # fmt: skip
    parser.add_argument("--judge-base-url", default=envs.JUDGE_BASE_URL.get(),
                        help="OpenAI-compatible judge endpoint (default: $DSINFER_JUDGE_BASE_URL)")  # fmt: skip
    parser.add_argument("--judge-model", default=envs.JUDGE_MODEL.get(),
                        help="judge model (default: $DSINFER_JUDGE_MODEL, else the endpoint's only model)")  # fmt: skip
    parser.add_argument("--judge-api-key", default=None,
                        help="judge API key (default: $DSINFER_JUDGE_API_KEY, else $OPENAI_API_KEY)")  # fmt: skip
    parser.add_argument("--judge-max-tokens", type=positive_int, default=2048, help="tokens for the verdict reply")
    parser.add_argument("--concurrency", type=positive_int, default=16, help="judge requests in flight")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per judge request")
    parser.add_argument("--max-retries", type=int, default=3)
    parser.add_argument("--no-progress", action="store_true")
    return parser


def cmd_run(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    samples = args.samples or DEFAULT_SAMPLES[args.benchmark]
    if args.base_url is None and (args.model or args.api_key):
        raise EvalError("--model and --api-key go with --base-url; --model-dir names the checkpoint itself")
    options = GenerationOptions(args.temperature, args.top_p, args.max_tokens, args.reasoning_effort)
    run = GenerationRun(args.benchmark, args.data, samples, options, args.seed, args.concurrency, args.limit)
    load_dataset(args.benchmark, args.data)  # a bad file is reported before a model is loaded or a server asked
    if args.base_url is not None:
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
        backend = OpenAIBackend(args.base_url, args.model, api_key, args.request_timeout, args.max_retries)
    else:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        backend = OfflineBackend(args.model_dir, device, dtype, args.concurrency, args.max_model_len)
    report = run_generation(run, backend, args.out, progress=not args.no_progress)
    print(f"{args.benchmark}: {report.total} samples ({report.reused} already done, {report.generated} generated, "
          f"{report.errors} failed) in {report.out_dir}")  # fmt: skip
    if report.errors:
        print(f"{report.errors} samples failed; rerun the same command to retry them", file=sys.stderr)
        return EXIT_SAMPLES_FAILED
    return 0


def cmd_grade(argv: list[str]) -> int:
    args = grade_parser().parse_args(argv)
    benchmark = read_manifest(_directory(args.directory)).get("benchmark")
    judge_name = args.judge or DEFAULT_JUDGE.get(benchmark, "llm")
    llm_judge = None
    if judge_name == "llm" and args.judge_base_url:
        from dsinfer.eval.judges import LLMJudge

        api_key = args.judge_api_key or envs.JUDGE_API_KEY.get() or os.environ.get("OPENAI_API_KEY")
        llm_judge = LLMJudge(args.judge_base_url, args.judge_model, api_key, args.request_timeout, args.max_retries,
                             args.judge_max_tokens)  # fmt: skip
    summary = grade_run(args.directory, judge_name, llm_judge, concurrency=args.concurrency,
                        progress=not args.no_progress)  # fmt: skip
    shown = {k: v for k, v in summary.items() if k not in ("per_question", "settings")}
    print(json.dumps(shown, indent=2))
    if not summary["coverage_complete"]:
        print("coverage is incomplete: pass@1 is not valid yet (see missing / errors above)", file=sys.stderr)
    return 0


def _directory(path: str) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise EvalError(f"run directory {directory} does not exist")
    return directory


def main(argv: list[str]) -> int:
    """Entry point of ``dsinfer eval``: argv[0] is ``run`` or ``grade``."""
    if not argv or argv[0] not in ("run", "grade"):
        print("usage: dsinfer eval run|grade ARGS... (see --help of each)", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    try:
        return cmd_run(rest) if command == "run" else cmd_grade(rest)
    except EvalError as exc:
        print(f"dsinfer eval {command}: error: {exc}", file=sys.stderr)
        return 2
