"""The options of ``dsinfer bench sweep``: its parser, the defaults that depend on other options, and checks that
name the flag a bad value came from; also which data-parallel rank this process is."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import torch

from dsinfer.config import KV_CACHE_DTYPES, ConfigError, parse_speculative_config

OFFICIAL_CONTEXT = 131072
DEFAULT_POINTS = {"decode": (1, 2, 4, 8, 16, 32, 64, 128, 256), "prefill": (4096, 8192, 16384, 32768, 65536)}
TINY_CONTEXT = 256
TINY_POINTS = {"decode": (1, 2, 4, 8), "prefill": (64, 128, 256, 512)}
ARCHES = ("v4", "v41")
FILL_CANDIDATES = (8192, 16384, 32768)  # token budgets the decode fill chooses among (--prefill-chunk auto)
CPU_FILL_BUDGET = 8192
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsinfer bench sweep",
        description="Steady-state decode / prefill sweep of the engine; writes results.jsonl and a Pareto PNG.",
    )
    parser.add_argument("mode", choices=["decode", "prefill"])
    _model_options(parser)
    _speculative_options(parser)
    _run_options(parser)
    return parser


def _model_options(parser: argparse.ArgumentParser) -> None:
    """What model the sweep runs: a checkpoint, a config's random weights, or a Flash slice of an arch."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="checkpoint directory (default: the embedded default model)")
    source.add_argument("--config", help="config.json (or its directory): random weights of that shape")
    source.add_argument("--flash-layers", type=int, help="random weights, every Flash width of --arch, N layers")
    parser.add_argument(
        "--arch",
        choices=ARCHES,
        default="v4",
        help="--flash-layers: V4-Flash (window / CSA / HCA) or V4.1-Flash (CSA2, Engram) widths",
    )
    parser.add_argument(
        "--engram-gib",
        type=float,
        help="V4.1 random weights: Engram tables of this size in host shared memory "
        "(default: 8 with --flash-layers, the config's own with --config)",
    )
    parser.add_argument(
        "--v41-prefill",
        choices=["bounded", "exact"],
        help="V4.1 prompts: bounded CED replay (default; exact with speculative decoding) or exact",
    )
    parser.add_argument(
        "--weight-format",
        choices=["native", "bf16"],
        default="native",
        help="random weights (--flash-layers, --config): routed experts packed FP4 as released, or bf16",
    )


def _speculative_options(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding: the assumed accounting's drafts, or real drafts and their benchmark devices."""
    parser.add_argument("--nextn", type=int, default=0, help="speculative drafts per step, for the assumed accounting")
    parser.add_argument("--accept", type=float, default=0.75, help="per-token draft acceptance (default 0.75)")
    parser.add_argument(
        "--speculative-config",
        metavar="JSON",
        default=None,
        help='decode: run speculative decoding, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\'',
    )
    parser.add_argument(
        "--coin-acceptance",
        type=float,
        metavar="RATE",
        default=None,
        help="decode with --speculative-config: a benchmark device that accepts each draft by a seeded coin of this "
        "rate (e.g. 0.75) instead of judging it, to time random weights' verify steps as real drafts would run them",
    )
    parser.add_argument(
        "--time-spec-phases",
        action="store_true",
        help="decode with --speculative-config: time each graphed step's verify and draft replays apart (events "
        "around the replays; verify_ms and draft_ms in the record's measured block)",
    )


def _run_options(parser: argparse.ArgumentParser) -> None:
    """Where and how the points run: context, points, device, steps, cache, fill, outputs."""
    parser.add_argument("--tag", help="name of the output folder (default: MODE-ctxCONTEXT)")
    parser.add_argument("--context", type=int, help=f"prompt tokens (default {OFFICIAL_CONTEXT}; tiny: {TINY_CONTEXT})")
    parser.add_argument("--points", help="comma-separated: requests per rank (decode) or batch tokens (prefill)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--measure-steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="profile this many steps after the timed ones (kernels, gaps)")  # fmt: skip
    parser.add_argument("--out-root", default="sweeps", help="results go to OUT_ROOT/TAG/ (default: sweeps)")
    parser.add_argument("--cache-gib", type=float, help="KV cache budget (default: the engine's)")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="cache storage, the engine's option (fp8: V4's indexer keys as e4m3 codes with a ue8m0 scale per 128 "
        "channels, as released; auto: V4 bf16, V4.1 FP8 / FP4 codes)",
    )
    parser.add_argument(
        "--prefill-chunk",
        default="auto",
        help="decode: token budget of the untimed fill; auto (default): on CUDA the candidate of "
        f"{', '.join(map(str, FILL_CANDIDATES))} that prefills fastest, else {CPU_FILL_BUDGET}",
    )
    parser.add_argument(
        "--fill-prompts",
        type=int,
        default=4,
        help="decode: distinct prompts prefilled per point; the other sequences are device copies of their "
        "caches (0: prefill every prompt) (default: 4)",
    )
    parser.add_argument("--telemetry-interval", type=float, default=5.0, help="seconds between GPU samples; 0: off")
    parser.add_argument("--compare-published", action="store_true", help="plot DeepInfer's B200 points too")
    parser.add_argument("--enforce-eager", action="store_true", help="decode without CUDA graphs")
    parser.add_argument("--seed", type=int, default=0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse and fill the defaults that depend on other options; bad values raise ValueError naming the flag."""
    args = build_parser().parse_args(argv)
    tiny = args.model is None and args.config is None and args.flash_layers is None
    if args.context is None:
        args.context = TINY_CONTEXT if tiny else OFFICIAL_CONTEXT
    if args.points is None:
        args.points = list((TINY_POINTS if tiny else DEFAULT_POINTS)[args.mode])
    else:
        args.points = _parse_points(args.points)
    if args.dtype is None:
        args.dtype = "bfloat16" if torch.device(args.device).type == "cuda" else "float32"
    if args.tag is None:
        args.tag = f"{args.mode}-ctx{args.context}"
    try:
        args.speculative = parse_speculative_config(args.speculative_config)
    except ConfigError as exc:
        raise ValueError(f"--speculative-config: {exc}") from None
    if args.coin_acceptance is not None and (args.speculative is None or not 0 <= args.coin_acceptance <= 1):
        raise ValueError("--coin-acceptance: a rate from 0 to 1, with --speculative-config (it judges real drafts)")
    if args.speculative is not None and args.nextn == 0:
        args.nextn = args.speculative.num_speculative_tokens
    args.prefill_chunk = _parse_fill_budget(args.prefill_chunk)
    _check_args(args)
    return args


def _parse_points(text: str) -> list[int]:
    try:
        points = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--points: expected comma-separated positive integers, got {text!r}") from None
    if not points or any(p <= 0 for p in points):
        raise ValueError(f"--points: expected comma-separated positive integers, got {text!r}")
    return sorted(set(points))


def _parse_fill_budget(text: str) -> int | None:
    """``auto`` (None: chosen per sweep by :func:`dsinfer.bench.sweep_points.fastest_fill_budget`) or a count."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--prefill-chunk: expected a positive integer or 'auto', got {text!r}") from None


def _check_args(args: argparse.Namespace) -> None:
    checks = [
        (args.context >= 1, f"--context: expected a positive integer, got {args.context}"),
        (args.nextn >= 0, f"--nextn: must not be negative, got {args.nextn}"),
        (0.0 <= args.accept <= 1.0, f"--accept: a per-token probability in [0, 1], got {args.accept}"),
        (args.warmup_steps >= 0, f"--warmup-steps: must not be negative, got {args.warmup_steps}"),
        (args.measure_steps >= 1, f"--measure-steps: expected at least 1, got {args.measure_steps}"),
        (args.profile_steps >= 0, f"--profile-steps: must not be negative, got {args.profile_steps}"),
        (args.fill_prompts >= 0, f"--fill-prompts: must not be negative, got {args.fill_prompts}"),
        (args.prefill_chunk is None or args.prefill_chunk >= 1,
         f"--prefill-chunk: expected a positive integer or 'auto', got {args.prefill_chunk}"),
        (args.engram_gib is None or args.engram_gib > 0, f"--engram-gib: must be positive, got {args.engram_gib}"),
        (args.cache_gib is None or args.cache_gib > 0, f"--cache-gib: must be positive, got {args.cache_gib}"),
        (args.telemetry_interval >= 0, f"--telemetry-interval: must not be negative, got {args.telemetry_interval}"),
        (args.flash_layers is None or args.flash_layers >= 1, f"--flash-layers: must be >= 1, got {args.flash_layers}"),
        (re.fullmatch(r"[A-Za-z0-9._-]+", args.tag) is not None and args.tag not in (".", ".."),
         f"--tag: letters, digits, '.', '_' and '-' only, got {args.tag!r}"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    if args.mode == "prefill" and (args.nextn or args.speculative is not None):
        raise ValueError("--nextn / --speculative-config: speculative decoding applies to decode sweeps only")
    if args.arch == "v41" and args.flash_layers is None and args.config is None:
        raise ValueError("--arch v41: builds random weights of --flash-layers N (a checkpoint or config says its own)")
    if args.speculative is not None and args.v41_prefill == "bounded":
        raise ValueError("--v41-prefill bounded: the drafts read every prompt position's hidden states; use exact")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA device is available")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"--device: expected cpu or cuda[:N], got {args.device!r}")
    if args.model is not None and not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model}: not a directory")


def dp_rank() -> int:
    """This process's data-parallel rank: DP_RANK, else RANK, else 0."""
    return _int_env(("DP_RANK", "RANK"), 0)


def world_size() -> int:
    """DP_SIZE, else WORLD_SIZE, else 1."""
    return _int_env(("DP_SIZE", "WORLD_SIZE"), 1)


def _int_env(names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip():
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}: expected an integer, got {value!r}") from None
    return default
