"""Steady-state sweeps of the engine, as DeepInfer's ``run_sweep.sh`` draws its prefill and decode Pareto charts.

    dsinfer bench sweep decode  [--model DIR | --config config.json | --flash-layers N] [--tag TAG]
                                [--context N] [--nextn N] [--accept P] [--points 1,2,4,...]
                                [--speculative-config '{"method": "mtp", "num_speculative_tokens": K}']
                                [--device cuda] [--dtype bfloat16] [--warmup-steps 3] [--measure-steps 10]
                                [--profile-steps 0] [--out-root sweeps] [--cache-gib G] [--prefill-chunk 8192]
                                [--telemetry-interval 5] [--compare-published] [--seed 0]
    dsinfer bench sweep prefill ... (same options; --nextn / --accept do not apply)
    dsinfer bench sweep encoder ... (images per batch: :mod:`dsinfer.bench.encoder_sweep`)
    scripts/run_sweep.sh decode ce-128k 131072 3 0.75      # the positional form
    scripts/run_sweep.sh prefill pe-128k 131072

Without a model option the embedded default model runs (context 256, small points): a CPU check of the
tool, not a performance number. ``--config`` or ``--flash-layers N`` (every V4-Flash width, N layers cycling
window / CSA / HCA) build random weights, so real shapes can be measured without the checkpoint.

What one point measures (one engine per point, one process = one DP rank = one GPU):

* decode, point = requests per DP rank (n): n sequences whose prompts are ``--context`` random tokens are
  prefilled first (not timed, chunk budget ``--prefill-chunk``); then ``--warmup-steps`` decode steps are run
  and discarded and ``--measure-steps`` decode steps are timed, each ``LLMEngine.step()`` on its own
  (wall clock around the call; the engine synchronises CUDA after the forward, and sampling reads the tokens
  back, so a step's time is the GPU's too). Sequences never finish during the timed steps.
* prefill, point = batch tokens per step (p): the chunked-prefill budget is p and the queue holds enough
  ``--context``-token prompts (each generating one token, then finishing) that every timed step prefills
  exactly p new tokens, spread over positions 0..context as in a long prompt. Since a step at position 100k
  costs more than one at 0, the measured steps are rounded up to whole cycles of the position pattern
  (``lcm(p, context) / p`` steps) so the mean is not biased; ``covers_full_cycle`` says whether that held.
  Prefix caching is off: every input token is uncached.

Headline numbers use the mean over the timed steps (total tokens / total time is what a throughput is;
prefill steps differ systematically by position); the median and spread are recorded beside it.

Output, written only by dp_rank 0 (``DP_RANK``, else ``RANK``; others run and print but write nothing):
``<out-root>/<tag>/results.jsonl`` (one JSON object per point, appended as each point finishes),
``pareto.png``, ``summary.json`` (command, skipped points, telemetry summary) and, on CUDA with NVML,
``telemetry.csv`` (see :mod:`dsinfer.bench.telemetry`). Decode points hold the sampler over their timed steps:
a step that meets an NVML read takes milliseconds longer, and a step is too short for a reading to describe.

Fields of each results.jsonl record:

==========================  =======================================================================================
tag, mode                   the sweep's tag; "decode" or "prefill"
point, point_unit           the swept value: "requests per DP rank" (decode) or "batch tokens per step" (prefill)
context                     prompt length in tokens (decode: context at the first fill; see context_range)
ms_per_step                 mean wall time of one timed step, milliseconds (= 1000 * measured_s / steps)
median_ms_per_step,
min_ms_per_step,
max_ms_per_step,
p90_ms_per_step             the spread of the timed steps
steps, warmup_steps         timed steps; steps run and discarded before them
measured_s                  total seconds of the timed steps
tokens_per_step             tokens computed per step on this rank: n (decode, one per sequence) or p (prefill)
tokens_per_s_per_gpu        tokens_per_step / (ms_per_step / 1000): output tokens/s (decode, measured
                            accounting) or uncached input tokens/s (prefill) of this rank's GPU (or CPU)
throughput_kind             "output tokens" or "uncached input tokens": what tokens_per_s_per_gpu counts
tokens_per_step_per_user    decode: tokens_per_step / n (1.0: no drafts run); prefill: null
tokens_per_s_per_user       decode: tokens_per_step_per_user / (ms_per_step / 1000); prefill: null
irregular_steps             timed steps that did not compute exactly tokens_per_step tokens (0 = clean)
preemptions                 scheduler preemptions during the point (0 = clean)
step_time_share             schedule / model / postprocess shares of the timed time (``LLMEngine.last_step``)
context_range               decode: [shortest sequence at the first timed step, longest at the last]
fill_steps, fill_s          decode: steps and seconds of the untimed prefill that filled the engine
requests                    prefill: prompts queued for the point
position_cycle_steps,
covers_full_cycle           prefill: lcm(p, context) / p, and whether the timed steps are whole cycles
nextn, accept, speculative  decode: drafts per step and per-token acceptance given; speculative is the
                            engine's speculative config when --speculative-config runs drafts, "not run,
                            measured = no drafts" when only --nextn is given, "off (nextn = 0)" otherwise
measured                    decode: the measured accounting: tokens actually sampled per step per user,
                            tokens_per_s_per_user, tokens_per_s_per_gpu (equal to the headline fields); with
                            drafts also tau (1 + accepted drafts per verify round, from the engine's counters),
                            drafts and accepted (the counts over the timed steps), graphed_steps (timed steps
                            whose verify and drafting replayed CUDA graphs, or their static path on the CPU)
assumed                     decode: the official accounting, tokens_per_step_per_user = 1 + nextn * accept
                            (tau; 3.25 for nextn 3, accept 0.75) applied to the measured step time:
                            tokens_per_s_per_user = tau / s_per_step, tokens_per_s_per_gpu = n * tau / s_per_step;
                            also chained_tokens_per_step = 1 + accept + ... + accept**nextn (the expectation
                            when a rejected draft discards the drafts after it) and a note on its step time
model, model_source,
weights                     what ran: a label, where it came from, "checkpoint" or "random"
num_layers, hidden_size,
n_routed_experts,
vocab_size                  the model's shape
dtype, device, gpu_name     compute dtype, torch device, GPU name (torch / NVML) or "cpu"
engine                      every EngineConfig option of the point's engine
gc                          Python's collections inside the timed steps (per generation), their ms and longest
step_ms                     each timed step's time, in order
profile                     decode with --profile-steps N: N more steps profiled after the timed ones (kernels,
                            busy / span / idle ms, each also per step, the costliest names and largest gaps:
                            :func:`dsinfer.bench.step_profile.timeline_summary`); absent otherwise
sampling                    "greedy, ignore_eos"
dp_rank, world_size         from DP_RANK / RANK and DP_SIZE / WORLD_SIZE (default 0 and 1)
seed                        seed of the random prompts (and random weights)
timestamp                   UTC, ISO 8601, when the point finished
dsinfer_version,
torch_version               software that produced the numbers
==========================  =======================================================================================

Speculative decoding: DeepInfer's decode chart fixes nextn=3, assumes 75% per-token acceptance, times steps
as if every draft were accepted (each step verifies 1 + nextn tokens per sequence) and credits
tau = 1 + nextn * accept = 3.25 tokens per step. The ``assumed`` accounting applies that tau to *our* measured
step. With ``--speculative-config`` the engine really drafts (V4's MTP layer; random weights get an MTP layer
of random weights too) and verifies 1 + K tokens per sequence per step, so the step time is the real one and
``measured`` holds the real tau (about 1 on random weights, which draft badly); ``--nextn`` defaults to K there.
Without it, ``--nextn`` only feeds the assumed accounting of a step that runs no drafts.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from dsinfer.bench.gc_pauses import GcPauses
from dsinfer.bench.shapes import flash_slice_config
from dsinfer.bench.step_profile import profile_steps
from dsinfer.config import ConfigError, EngineConfig, ModelConfig, parse_speculative_config
from dsinfer.engine.engine import LLMEngine, StepStats
from dsinfer.engine.gc_heap import freeze_heap, thaw_heap
from dsinfer.models.deepseek_v4 import DeepseekV4
from dsinfer.models.loader import CheckpointError
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer, TokenizerLoadError

OFFICIAL_CONTEXT = 131072
DEFAULT_POINTS = {"decode": (1, 2, 4, 8, 16, 32, 64, 128, 256), "prefill": (4096, 8192, 16384, 32768, 65536)}
TINY_CONTEXT = 256
TINY_POINTS = {"decode": (1, 2, 4, 8), "prefill": (64, 128, 256, 512)}
SPECULATIVE_NOT_RUN = "not run, measured = no drafts"
MAX_POSITION_CYCLE = 1024  # beyond this many steps the prefill position cycle is not completed
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class PointSkipped(Exception):
    """A point that cannot run here (cache too small, out of memory); the sweep records it and goes on."""


@dataclass
class Bench:
    """What every point of one sweep shares: the model (built once), its tokenizer, the options."""

    model: DeepseekV4
    tokenizer: Tokenizer
    info: dict[str, Any]
    args: argparse.Namespace
    sampler: Any = None  # the sweep's TelemetrySampler while it samples

    def telemetry_held(self):
        """Hold the GPU telemetry over decode steps: an NVML read stalls the step it meets by milliseconds."""
        return self.sampler.held() if self.sampler is not None else nullcontext()

    @property
    def device(self) -> torch.device:
        return torch.device(self.args.device)


# ---- options ---------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsinfer bench sweep",
        description="Steady-state decode / prefill sweep of the engine; writes results.jsonl and a Pareto PNG.",
    )
    parser.add_argument("mode", choices=["decode", "prefill"])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="checkpoint directory (default: the embedded default model)")
    source.add_argument("--config", help="config.json (or its directory): random weights of that shape")
    source.add_argument("--flash-layers", type=int, help="random weights, every V4-Flash width, N layers")
    parser.add_argument(
        "--weight-format",
        choices=["native", "bf16"],
        default="native",
        help="random weights (--flash-layers, --config): routed experts packed FP4 as released, or bf16",
    )
    parser.add_argument("--tag", help="name of the output folder (default: MODE-ctxCONTEXT)")
    parser.add_argument("--context", type=int, help=f"prompt tokens (default {OFFICIAL_CONTEXT}; tiny: {TINY_CONTEXT})")
    parser.add_argument("--nextn", type=int, default=0, help="speculative drafts per step, for the assumed accounting")
    parser.add_argument("--accept", type=float, default=0.75, help="per-token draft acceptance (default 0.75)")
    parser.add_argument(
        "--speculative-config",
        metavar="JSON",
        default=None,
        help='decode: run speculative decoding, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\'',
    )
    parser.add_argument("--points", help="comma-separated: requests per rank (decode) or batch tokens (prefill)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--measure-steps", type=int, default=10)
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="decode: profile this many steps after the timed ones (kernels, gaps)")  # fmt: skip
    parser.add_argument("--out-root", default="sweeps", help="results go to OUT_ROOT/TAG/ (default: sweeps)")
    parser.add_argument("--cache-gib", type=float, help="KV cache budget (default: the engine's)")
    parser.add_argument("--prefill-chunk", type=int, default=8192, help="decode: token budget of the untimed fill")
    parser.add_argument("--telemetry-interval", type=float, default=5.0, help="seconds between GPU samples; 0: off")
    parser.add_argument("--compare-published", action="store_true", help="plot DeepInfer's B200 points too")
    parser.add_argument("--enforce-eager", action="store_true", help="decode without CUDA graphs")
    parser.add_argument("--seed", type=int, default=0)
    return parser


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
    if args.speculative is not None and args.nextn == 0:
        args.nextn = args.speculative.num_speculative_tokens
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


def _check_args(args: argparse.Namespace) -> None:
    checks = [
        (args.context >= 1, f"--context: expected a positive integer, got {args.context}"),
        (args.nextn >= 0, f"--nextn: must not be negative, got {args.nextn}"),
        (0.0 <= args.accept <= 1.0, f"--accept: a per-token probability in [0, 1], got {args.accept}"),
        (args.warmup_steps >= 0, f"--warmup-steps: must not be negative, got {args.warmup_steps}"),
        (args.measure_steps >= 1, f"--measure-steps: expected at least 1, got {args.measure_steps}"),
        (args.profile_steps >= 0, f"--profile-steps: must not be negative, got {args.profile_steps}"),
        (args.prefill_chunk >= 1, f"--prefill-chunk: expected a positive integer, got {args.prefill_chunk}"),
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
    if args.mode == "prefill" and args.profile_steps:
        raise ValueError("--profile-steps: profiles decode steps; a prefill sweep takes none")
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


# ---- the model -------------------------------------------------------------------------------
def build_bench(args: argparse.Namespace) -> Bench:
    """Load the checkpoint, or build random weights from a config; the model is shared by every point."""
    from dsinfer.models.loader import load_model
    from dsinfer.models.native_random import build_native_model
    from dsinfer.models.tiny import build_random_model, default_model_dir
    from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer

    dtype = DTYPES[args.dtype]
    config = None
    if args.flash_layers is not None:
        config = flash_slice_config(args.flash_layers)
        label, source = f"V4-Flash widths, {args.flash_layers} layers", f"--flash-layers {args.flash_layers}"
    elif args.config is not None:
        config = ModelConfig.from_file(args.config)
        label, source = f"{Path(args.config).name} shape", str(Path(args.config).resolve())
    if config is not None:
        drafting = args.speculative is not None
        if drafting and not config.num_nextn_predict_layers:
            config = replace(config, num_nextn_predict_layers=1)  # a random MTP layer to draft with
        if args.weight_format == "native":
            model = build_native_model(config, dtype, args.device, seed=args.seed, with_mtp=drafting)
        elif not drafting:
            model = build_random_model(config, dtype, args.device, seed=args.seed)
        else:
            model = build_random_model(config, dtype, args.device, seed=args.seed)
        with tempfile.TemporaryDirectory() as directory:  # a tokenizer only for ids; the prompts are random
            build_tiny_tokenizer(Path(directory), vocab_size=config.vocab_size)
            tokenizer = Tokenizer.from_dir(directory)
        weights = "random"
    else:
        directory = Path(args.model) if args.model is not None else default_model_dir()
        model = load_model(directory, dtype=dtype, device=args.device, progress=False)
        tokenizer = Tokenizer.from_dir(directory)
        label = "embedded default model" if args.model is None else f"checkpoint {directory.name}"
        source, weights = str(directory.resolve()), "checkpoint"
    cfg = model.config
    info = {
        "model": label,
        "model_source": source,
        "weights": weights if weights == "checkpoint" else f"{weights} ({args.weight_format})",
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "n_routed_experts": cfg.n_routed_experts,
        "vocab_size": cfg.vocab_size,
    }
    return Bench(model, tokenizer, info, args)


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def decode_max_model_len(args: argparse.Namespace, num_requests: int) -> int:
    """Room for the prompt, the tokens sampled while the others still prefill, and every decode step."""
    fill_budget = max(args.prefill_chunk, num_requests)
    fill_steps_bound = math.ceil(num_requests * args.context / fill_budget) + num_requests
    per_step = 1 + (args.speculative.num_speculative_tokens if args.speculative is not None else 0)
    steps = args.warmup_steps + args.measure_steps + args.profile_steps
    return args.context + fill_steps_bound + steps * per_step + per_step + 2


def check_fits_model(args: argparse.Namespace, config: ModelConfig) -> None:
    """The longest sequence of the sweep must fit the model's positions; say which flag to change."""
    longest = max(decode_max_model_len(args, p) for p in args.points) if args.mode == "decode" else args.context + 1
    if longest > config.max_position_embeddings:
        raise ValueError(
            f"--context {args.context}: sequences reach {longest} tokens, beyond the model's "
            f"max_position_embeddings ({config.max_position_embeddings}); lower --context"
        )


# ---- timing ----------------------------------------------------------------------------------
def make_engine(bench: Bench, **options) -> LLMEngine:
    """A fresh engine for one point; prefix caching off so every prompt token is computed.

    The previous engine's cache must be back with the device first: on CUDA the engine sizes its cache from
    the free memory, and memory the caching allocator still holds does not count as free.
    """
    args = bench.args
    release_memory(bench.device)
    cache_bytes = None if args.cache_gib is None else int(args.cache_gib * 2**30)
    options = {"enable_prefix_caching": False, "cache_memory_bytes": cache_bytes,
               "enforce_eager": args.enforce_eager, **options}  # fmt: skip
    config = EngineConfig(device=args.device, dtype=args.dtype, **options)
    try:
        return LLMEngine(bench.model, bench.tokenizer, config)
    except ValueError as exc:  # the cache budget cannot hold one sequence
        raise PointSkipped(str(exc)) from None


def release_memory(device: torch.device) -> None:
    """Drop what finished engines left behind, so the next one sees the whole device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check_cache_holds(engine: LLMEngine, sequences: int, tokens_each: int) -> None:
    """Skip the point rather than let preemption thrash: all sequences must fit the cache at once."""
    per_sequence = math.ceil(tokens_each / engine.runner.block_tokens)
    if sequences * per_sequence > engine.runner.num_blocks:
        raise PointSkipped(
            f"the cache holds {engine.runner.num_blocks} blocks of {engine.runner.block_tokens} tokens; "
            f"{sequences} sequences of {tokens_each} tokens need {sequences * per_sequence} (raise --cache-gib)"
        )


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (ids above the three leading specials), so no two share a cached prefix."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size - 1, (length,), generator=generator).tolist() for _ in range(count)]


def run_steps(engine: LLMEngine, count: int) -> None:
    """Untimed steps (warm-up, fill)."""
    for _ in range(count):
        _checked_step(engine)


def timed_steps(
    engine: LLMEngine, measure: int, quiet=None
) -> tuple[list[tuple[float, StepStats]], dict[str, Any], list[float]]:
    """Time ``measure`` steps one by one: (seconds, the engine's StepStats of that step), the collector's pauses
    among them, and the window they ran in (``time.monotonic()``). The heap is frozen meanwhile (frozen before
    the window opens), as ``dsinfer serve`` freezes it once its engine is up. ``quiet``: a context held over the
    steps (the telemetry's :meth:`~Bench.telemetry_held`)."""
    freeze_heap()
    timed = []
    window = [time.monotonic()]
    try:
        with GcPauses() as pauses, quiet or nullcontext():
            for _ in range(measure):
                start = time.perf_counter()
                _checked_step(engine)
                timed.append((time.perf_counter() - start, engine.last_step))
    finally:
        thaw_heap()  # this process builds and drops an engine per point
    window.append(time.monotonic())
    return timed, pauses.summary(), window


def _checked_step(engine: LLMEngine) -> None:
    if not engine.has_unfinished_requests():
        raise RuntimeError("the engine ran out of work inside the timed window (a sweep bookkeeping bug)")
    engine.step()


def step_statistics(timed: list[tuple[float, StepStats]], expected_tokens: int) -> dict[str, Any]:
    """Mean-based headline numbers plus the spread; tokens/s is tokens/step over s/step by construction."""
    seconds = [s for s, _ in timed]
    p90 = statistics.quantiles(seconds, n=10, method="inclusive")[-1] if len(seconds) > 1 else seconds[0]
    tokens = [stats.num_tokens for _, stats in timed]
    measured_s = sum(seconds)
    ms_per_step = 1e3 * measured_s / len(timed)
    tokens_per_step = sum(tokens) / len(timed)
    shares = {
        part: sum(getattr(stats, f"{part}_s") for _, stats in timed) for part in ("schedule", "model", "postprocess")
    }
    inside = sum(shares.values()) or 1.0
    return {
        "ms_per_step": ms_per_step,
        "median_ms_per_step": 1e3 * statistics.median(seconds),
        "min_ms_per_step": 1e3 * min(seconds),
        "max_ms_per_step": 1e3 * max(seconds),
        "p90_ms_per_step": 1e3 * p90,
        "steps": len(timed),
        "step_ms": [round(1e3 * s, 4) for s in seconds],  # in order: where the slow steps fell
        "measured_s": measured_s,
        "tokens_per_step": tokens_per_step,
        "tokens_per_s_per_gpu": tokens_per_step / (ms_per_step / 1e3),
        "irregular_steps": sum(1 for t in tokens if t != expected_tokens),
        "step_time_share": {key: value / inside for key, value in shares.items()},
    }


def speculative_accounting(
    nextn: int,
    accept: float,
    num_requests: int,
    measured: dict[str, Any],
    drafted: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The measured accounting (what ran) and the assumed, official one (tau = 1 + nextn * accept per step).

    ``drafted`` (speculative runs): ``config`` (the engine's speculative config), ``sampled`` (tokens emitted
    in the timed steps), ``drafts`` / ``draft_tokens`` / ``accepted`` (the engine's counters over them)."""
    s_per_step = measured["ms_per_step"] / 1e3
    tau = 1 + nextn * accept
    if drafted is None:
        per_user = measured["tokens_per_step"] / num_requests
        real = {"basis": "tokens sampled in the timed steps; no drafts run"}
        speculative = SPECULATIVE_NOT_RUN if nextn > 0 else "off (nextn = 0)"
    else:
        per_user = drafted["sampled"] / measured["steps"] / num_requests
        rounds = drafted["drafts"]
        real = {
            "basis": "tokens sampled in the timed steps, drafts verified by the engine",
            "tau": 1 + drafted["accepted"] / rounds if rounds else 1.0,
            "drafts": drafted["draft_tokens"],
            "accepted": drafted["accepted"],
            "graphed_steps": drafted.get("graphed_steps", 0),
        }
        speculative = drafted["config"]
    return {
        "nextn": nextn,
        "accept": accept,
        "speculative": speculative,
        "measured": {
            "tokens_per_step_per_user": per_user,
            "tokens_per_s_per_user": per_user / s_per_step,
            "tokens_per_s_per_gpu": measured["tokens_per_s_per_gpu"]
            if drafted is None
            else per_user * num_requests / s_per_step,
            **real,
        },
        "assumed": {
            "formula": "1 + nextn * accept",
            "tokens_per_step_per_user": tau,
            "tokens_per_s_per_user": tau / s_per_step,
            "tokens_per_s_per_gpu": num_requests * tau / s_per_step,
            "chained_tokens_per_step": sum(accept**k for k in range(nextn + 1)),
            "step_time": "the measured step (one token verified per sequence, no draft model); the official "
            "chart's step verifies 1 + nextn tokens per sequence and runs the drafts, so this is an upper bound",
        },
    }


# ---- the points ------------------------------------------------------------------------------
def run_decode_point(bench: Bench, num_requests: int) -> dict[str, Any]:
    """Fill the engine with ``num_requests`` prompts of ``context`` tokens, then time steady-state decode steps."""
    args = bench.args
    max_model_len = decode_max_model_len(args, num_requests)
    # The timed steps all decode num_requests sequences: one CUDA graph bucket of that size is all they replay
    # (capturing every power of two below it would only lengthen the point's set-up).
    graphs = {"cuda_graph_sizes": (num_requests,)} if str(args.device).startswith("cuda") else {}
    engine = make_engine(bench, max_num_seqs=num_requests, max_num_batched_tokens=max(args.prefill_chunk, num_requests),
                         max_model_len=max_model_len, speculative_config=args.speculative, **graphs)  # fmt: skip
    check_cache_holds(engine, num_requests, max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    for prompt in random_prompts(num_requests, args.context, bench.model.config.vocab_size, args.seed):
        engine.add_request(prompt, params)
    sequences = [seq for group in engine.requests.values() for seq in group]
    fill_start, fill_steps = time.perf_counter(), 0
    while not all(seq.output_token_ids for seq in sequences):  # untimed: every prompt prefilled once
        _checked_step(engine)
        fill_steps += 1
    fill_s = time.perf_counter() - fill_start
    run_steps(engine, args.warmup_steps)
    shortest = min(seq.num_tokens for seq in sequences)
    sampled_before = sum(len(seq.output_token_ids) for seq in sequences)
    stats_before = replace(engine.spec_stats) if engine.spec_stats is not None else None
    executor = engine.worker.speculative
    graphed_before = executor.graphed_steps if executor is not None else 0
    timed, collector, window = timed_steps(engine, args.measure_steps, bench.telemetry_held())
    if any(seq.is_finished for seq in sequences):
        raise RuntimeError("a sequence finished inside the timed window (a sweep bookkeeping bug)")
    profile = None
    if args.profile_steps:  # after the timing: a profiler session slows what runs after it
        profile = profile_steps(lambda: _checked_step(engine), args.profile_steps, bench.device)
    drafts_per_step = args.speculative.num_speculative_tokens if args.speculative is not None else 0
    measured = step_statistics(timed, expected_tokens=num_requests * (1 + drafts_per_step))
    drafted = None
    if stats_before is not None:
        stats = engine.spec_stats
        drafted = {
            "config": asdict(args.speculative),
            "sampled": sum(len(seq.output_token_ids) for seq in sequences) - sampled_before,
            "drafts": stats.num_drafts - stats_before.num_drafts,
            "draft_tokens": stats.num_draft_tokens - stats_before.num_draft_tokens,
            "accepted": stats.num_accepted_tokens - stats_before.num_accepted_tokens,
            "graphed_steps": executor.graphed_steps - graphed_before,
        }
    accounting = speculative_accounting(args.nextn, args.accept, num_requests, measured, drafted)
    if drafted is not None:  # the headline counts output tokens, not the verified positions
        measured["tokens_per_s_per_gpu"] = accounting["measured"]["tokens_per_s_per_gpu"]
    return {
        "point_unit": "requests per DP rank",
        **measured,
        "throughput_kind": "output tokens",
        "tokens_per_step_per_user": accounting["measured"]["tokens_per_step_per_user"],
        "tokens_per_s_per_user": accounting["measured"]["tokens_per_s_per_user"],
        "preemptions": engine.scheduler.num_preemptions,
        "context_range": [shortest, max(seq.num_tokens for seq in sequences)],
        "fill_steps": fill_steps,
        "fill_s": fill_s,
        "timed_window": window,
        "gc": collector,
        **accounting,
        "engine": asdict(engine.config),
        **({"profile": profile} if profile is not None else {}),
    }


def prefill_measure_steps(context: int, batch_tokens: int, requested: int) -> tuple[int, int]:
    """Timed steps rounded up to whole position cycles (when the cycle is not absurdly long), and the cycle."""
    cycle = math.lcm(context, batch_tokens) // batch_tokens
    if cycle > MAX_POSITION_CYCLE:
        return requested, cycle
    return math.ceil(requested / cycle) * cycle, cycle


def run_prefill_point(bench: Bench, batch_tokens: int) -> dict[str, Any]:
    """Time steps that each prefill exactly ``batch_tokens`` new tokens of ``context``-token prompts."""
    args = bench.args
    measure, cycle = prefill_measure_steps(args.context, batch_tokens, args.measure_steps)
    slots = math.ceil(batch_tokens / args.context) + 1  # a step may hold a tail, whole prompts and a head
    engine = make_engine(bench, max_num_seqs=slots, max_num_batched_tokens=batch_tokens, max_model_len=args.context + 1)
    check_cache_holds(engine, slots, args.context + 1)
    total_steps = args.warmup_steps + measure
    requests = math.ceil(total_steps * batch_tokens / args.context) + 1  # +1: the last timed step stays full
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # finish as soon as prefilled
    for prompt in random_prompts(requests, args.context, bench.model.config.vocab_size, args.seed):
        engine.add_request(prompt, params)
    run_steps(engine, args.warmup_steps)
    timed, collector, window = timed_steps(engine, measure)
    return {
        "point_unit": "batch tokens per step",
        **step_statistics(timed, expected_tokens=batch_tokens),
        "throughput_kind": "uncached input tokens",
        "tokens_per_step_per_user": None,
        "tokens_per_s_per_user": None,
        "preemptions": engine.scheduler.num_preemptions,
        "requests": requests,
        "position_cycle_steps": cycle,
        "covers_full_cycle": measure % cycle == 0,
        "timed_window": window,
        "gc": collector,
        "engine": asdict(engine.config),
    }


def warm_up(bench: Bench) -> None:
    """One short request through every code path before the first point, so lazy set-up is not timed."""
    engine = make_engine(bench, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=32, num_cache_blocks=8)
    engine.add_request(random_prompts(1, 16, bench.model.config.vocab_size, bench.args.seed)[0],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # fmt: skip
    while engine.has_unfinished_requests():
        engine.step()


def run_point(bench: Bench, point: int) -> dict[str, Any]:
    """One point, with the engine's memory handed back afterwards (the next point sizes its cache from it)."""
    args = bench.args
    try:
        measured = (run_decode_point if args.mode == "decode" else run_prefill_point)(bench, point)
    except torch.OutOfMemoryError as exc:
        raise PointSkipped(f"out of memory: {str(exc).splitlines()[0]}") from None
    finally:
        release_memory(bench.device)
    from dsinfer import __version__

    return {
        "tag": args.tag,
        "mode": args.mode,
        "point": point,
        "context": args.context,
        **measured,
        "warmup_steps": args.warmup_steps,
        **bench.info,
        "dtype": args.dtype,
        "device": str(bench.device),
        "gpu_name": gpu_name(bench.device),
        "sampling": "greedy, ignore_eos",
        "dp_rank": dp_rank(),
        "world_size": world_size(),
        "seed": args.seed,
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "dsinfer_version": __version__,
        "torch_version": torch.__version__,
    }


def _describe(record: dict[str, Any]) -> str:
    line = f"{record['mode']} point {record['point']:>6}: {record['ms_per_step']:9.2f} ms/step, "
    line += f"{record['tokens_per_s_per_gpu']:11.1f} tokens/s/GPU"
    if record["mode"] == "decode":
        line += f", {record['tokens_per_s_per_user']:8.1f} tokens/s/user"
        if record["nextn"] > 0:
            line += f" (assumed accounting: {record['assumed']['tokens_per_s_per_user']:.1f})"
        real = record.get("measured", {})
        if "graphed_steps" in real:
            line += f", tau {real['tau']:.2f}, {real['graphed_steps']}/{record['steps']} steps graphed"
    utilization = (record.get("telemetry") or {}).get("columns", {}).get("gpu_util_percent")
    if utilization is not None:
        line += f", GPU busy {utilization['mean']:.0f}% ({record['telemetry']['samples']} samples)"
    return line


# ---- the sweep -------------------------------------------------------------------------------
def run_sweep(args: argparse.Namespace, argv: list[str]) -> int:
    from dsinfer.bench.telemetry import TelemetrySampler, summarize

    rank = dp_rank()
    world_size()  # a bad value fails now, not after the first point
    writes = rank == 0
    out_dir = Path(args.out_root) / args.tag
    if not writes:
        print(f"sweep: dp_rank {rank} runs the points but writes nothing (only dp_rank 0 writes)", file=sys.stderr)
    bench = build_bench(args)
    check_fits_model(args, bench.model.config)
    warm_up(bench)
    results_path = out_dir / "results.jsonl"
    if writes:
        out_dir.mkdir(parents=True, exist_ok=True)
        results_path.write_text("")
    sampler = None
    if writes and args.telemetry_interval > 0:
        if bench.device.type == "cuda":
            sampler = TelemetrySampler(out_dir / "telemetry.csv", args.telemetry_interval, [bench.device.index or 0])
            bench.sampler = sampler if sampler.start() else None
        else:
            print("telemetry: off, the sweep runs on the CPU; no telemetry.csv written", file=sys.stderr)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    records, skipped = [], []
    try:
        for point in args.points:
            try:
                record = run_point(bench, point)
                if sampler is not None and sampler.active:  # the GPU while this point's timed steps ran (rows
                    # whose reading reaches back before the window, i.e. taken in its first interval, left out)
                    start, end = (t - sampler.started_at for t in record["timed_window"])
                    record["telemetry"] = summarize(sampler.path, (start, end), lookback_s=args.telemetry_interval)
            except PointSkipped as exc:
                print(f"{args.mode} point {point:>6}: skipped, {exc}", file=sys.stderr)
                skipped.append({"point": point, "reason": str(exc)})
                continue
            print(_describe(record), flush=True)
            records.append(record)
            if writes:
                with results_path.open("a") as handle:
                    handle.write(json.dumps(record) + "\n")
    finally:
        if sampler is not None:
            sampler.stop()
    if not writes:
        return 0 if records else 1
    summary = {
        "tag": args.tag,
        "mode": args.mode,
        "argv": argv,
        "started": started,
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "points": [r["point"] for r in records],
        "skipped": skipped,
        "results": results_path.name,
        "pareto": None,
        "telemetry": None,
    }
    if sampler is not None and sampler.off_reason is None:
        summary["telemetry"] = {"file": sampler.path.name, **summarize(sampler.path)}
    elif sampler is not None:
        summary["telemetry"] = {"off": sampler.off_reason}
    if records:
        summary["pareto"] = _draw(records, out_dir / "pareto.png", args.compare_published)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if summary["telemetry"] is not None:
        print(f"telemetry: {json.dumps(summary['telemetry'])}")
    print(f"wrote {out_dir}/ ({len(records)} points, {len(skipped)} skipped)")
    if not records:
        print("sweep: no point could run; see the reasons above", file=sys.stderr)
        return 1
    return 0


def _draw(records: list[dict[str, Any]], path: Path, compare_published: bool) -> str | None:
    """Draw the Pareto PNG; a missing matplotlib costs the chart, never the measured points."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("sweep: matplotlib is not installed; pareto.png not drawn", file=sys.stderr)
        return None
    from dsinfer.bench.pareto import draw_pareto

    return draw_pareto(records, path, compare_published).name


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["encoder"]:  # images per batch through the V4.1 image encoder: its own options
        from dsinfer.bench.encoder_sweep import main as encoder_main

        return encoder_main(argv[1:])
    try:
        args = parse_args(argv)
        return run_sweep(args, argv)
    except (ValueError, ConfigError, CheckpointError, TokenizerLoadError) as exc:
        print(f"dsinfer bench sweep: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
