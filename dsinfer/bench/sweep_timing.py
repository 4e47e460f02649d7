"""How a sweep times engine steps: untimed and timed steps, the statistics of the timed ones, the measured and the
assumed (official) speculative accounting, and the prefill's whole position cycles."""

from __future__ import annotations

import math
import statistics
import time
from contextlib import nullcontext
from typing import Any

import torch

from dsinfer.bench.gc_pauses import GcPauses
from dsinfer.engine.engine import LLMEngine, StepStats
from dsinfer.engine.gc_heap import freeze_heap, thaw_heap

SPECULATIVE_NOT_RUN = "not run, measured = no drafts"
MAX_POSITION_CYCLE = 1024  # beyond this many steps the prefill position cycle is not completed


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Distinct random prompts (ids above the three leading specials), so no two share a cached prefix."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size - 1, (length,), generator=generator).tolist() for _ in range(count)]


def run_steps(engine: LLMEngine, count: int) -> None:
    """Untimed steps (warm-up, fill)."""
    for _ in range(count):
        checked_step(engine)


def timed_steps(
    engine: LLMEngine, measure: int, quiet=None
) -> tuple[list[tuple[float, StepStats]], dict[str, Any], list[float]]:
    """Time ``measure`` steps one by one: (seconds, the engine's StepStats of that step), the collector's pauses
    among them, and the window they ran in (``time.monotonic()``). The heap is frozen meanwhile (frozen before
    the window opens), as ``dsinfer serve`` freezes it once its engine is up. ``quiet``: a context held over the
    steps (the telemetry's :meth:`~Bench.telemetry_held`).

    A step may return before its device work ends (overlap scheduling; a prefill chunk whose prompt samples
    nothing yet is never waited for), so the device is drained before the window opens and inside the last
    step's time: the window holds exactly the timed steps' work, none of the untimed steps before and all of its
    own. Without it a window of few steps is off by up to a step's worth at each end."""
    freeze_heap()
    timed = []
    drain_device(engine)
    window = [time.monotonic()]
    try:
        with GcPauses() as pauses, quiet or nullcontext():
            for step in range(measure):
                start = time.perf_counter()
                checked_step(engine)
                if step == measure - 1:
                    drain_device(engine)
                timed.append((time.perf_counter() - start, engine.last_step))
    finally:
        thaw_heap()  # this process builds and drops an engine per point
    window.append(time.monotonic())
    return timed, pauses.summary(), window


def drain_device(engine: LLMEngine) -> None:
    """Wait for the device work the engine has launched: its device worker launches a step after the engine
    thread hands it over (a step launched ahead may still be on its way to the device), so the wait runs on the
    worker, behind the steps queued there."""
    device = torch.device(engine.config.device)
    engine.worker.run_between_steps(lambda: synchronize(device))


def synchronize(device: torch.device) -> None:
    """Wait for the work launched on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def recapture_graphs(engine: LLMEngine) -> None:
    """Record the engine's decode graphs and its speculative steps' graphs again, on its device worker between
    steps: a profiler session that starts with this sees the kernels of the graphs' replays, in it and in later
    sessions (:func:`dsinfer.bench.step_profile.profile_steps`)."""
    speculative = engine.worker.speculative
    for graphs in (engine.runner.decode_graphs, None if speculative is None else speculative.graphs):
        if graphs is not None:
            engine.worker.run_between_steps(graphs.recapture)


def checked_step(engine: LLMEngine) -> None:
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
            "basis": "tokens sampled in the timed steps, drafts verified by the engine"
            if drafted.get("coin_acceptance") is None
            else f"drafts accepted by a seeded coin at {drafted['coin_acceptance']} (benchmark device)",
            "tau": 1 + drafted["accepted"] / rounds if rounds else 1.0,
            "drafts": drafted["draft_tokens"],
            "accepted": drafted["accepted"],
            "graphed_steps": drafted.get("graphed_steps", 0),
            **(drafted.get("phases") or {}),  # verify_ms, draft_ms (--time-spec-phases)
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


def prefill_measure_steps(context: int, batch_tokens: int, requested: int) -> tuple[int, int]:
    """Timed steps rounded up to whole position cycles (when the cycle is not absurdly long), and the cycle."""
    cycle = math.lcm(context, batch_tokens) // batch_tokens
    if cycle > MAX_POSITION_CYCLE:
        return requested, cycle
    return math.ceil(requested / cycle) * cycle, cycle


def head_ms(hidden_size: int, vocab_size: int, rows: int, dtype: torch.dtype, device: torch.device) -> float:
    """Milliseconds of the output head's GEMM (``rows`` x hidden times hidden x vocab) timed alone: the part of a
    step that does not grow with the layers, kept out of the per-layer cost of the full-depth estimate."""
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(max(rows, 1), hidden_size, dtype=dtype, device=device, generator=generator)
    weight = torch.randn(vocab_size, hidden_size, dtype=dtype, device=device, generator=generator)
    repeats, times = 5, []
    for index in range(repeats + 1):
        synchronize(device)
        start = time.perf_counter()
        torch.nn.functional.linear(hidden, weight)
        synchronize(device)
        if index:  # the first call pays for the library's set-up
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)
