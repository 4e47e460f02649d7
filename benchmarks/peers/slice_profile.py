"""``vllm_slice.py --profile``: after a point is timed, the same work once more under the engine's profiler.

Timing comes first and is never profiled. The child times every point, then profiles them in order: a prefill
point runs one N-token prompt to its one output token inside the window; a ``generate``-method decode point adds
its B prompts of C tokens, steps until every sequence holds 1 + W tokens, and profiles the next P steps (P = 32, W
= 8, fewer where ``--decode-tokens`` is small), then runs the rest out. A ``stream``-method point (the long
contexts, where a second prefill of B x C tokens would not fit the run) is profiled inside its timed run, over the
P steps right after the timed window closes (its requests were given the room). A point whose profile would not
fit the time the child has left is skipped and says so, as is every later one. The trace of each window stays in
the profile directory; :mod:`slice_trace` turns it into the row's summary.

vLLM profiles in its own worker (``LLM.start_profile`` / ``stop_profile``, which its ``profiler_config`` enables;
vLLM creates the worker's profiler at the first start, so nothing of it runs while the points are timed, except
that a stream point timed after another point's profile runs with vLLM's per-step trace annotation in place).
dsinfer's child runs ``torch.profiler`` around its own ``step()`` calls.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from slice_timing import PROFILE_STEPS, STREAM_WARM_TOKENS, Point, PromptMaker, step_until_all_hold
from slice_trace import load_trace_events, summarize_trace

TRACE_ALLOWANCE_S = 15.0  # writing a window's trace and reading it back
RESERVE_S = 10.0  # what the child keeps for saving its result and exiting


class ProfiledEngine(Protocol):
    step_pattern: str

    def add(self, prompt: list[int], new_tokens: int) -> None: ...

    def step(self) -> list: ...

    def busy(self) -> bool: ...

    def start_profile(self, label: str) -> None: ...

    def stop_profile(self) -> Path:
        """Stop the profiler and return the trace file of the window."""
        ...


def trace_label(point: Point) -> str:
    """A file-name form of the point's label: ``decode-32-at-4096``."""
    return point.label.replace(" @ ", "-at-").replace(" ", "-")


def window_shape(decode_tokens: int) -> tuple[int, int]:
    """(W, P) for a ``generate``-method point: its requests make ``1 + decode_tokens`` tokens, as when timed, and
    at least three quarters of them are left once the P profiled steps start."""
    quarter = max(1, decode_tokens // 4)
    return min(STREAM_WARM_TOKENS, quarter), min(PROFILE_STEPS, quarter)


def run_steps(engine: ProfiledEngine, steps: int) -> None:
    for _ in range(steps):
        if not engine.busy():
            break
        engine.step()


def run_out(engine: ProfiledEngine) -> None:
    while engine.busy():
        engine.step()


def profile_window(engine: ProfiledEngine, label: str, work: Callable[[], None], top: int) -> dict[str, Any]:
    """``work`` under the engine's profiler; the summary of the window's trace."""
    engine.start_profile(label)
    try:
        work()
    finally:
        trace = engine.stop_profile()
    summary = summarize_trace(load_trace_events(trace), engine.step_pattern, top)
    return {**summary, "trace": trace.name}


def profile_point(point: Point, engine: ProfiledEngine, prompts: PromptMaker, decode_tokens: int, top: int) -> dict:
    """Profile a prefill or ``generate``-method decode point once more (see the module docstring)."""
    label = trace_label(point)
    if point.kind == "prefill":  # the profiler starts first: vLLM's engine core runs a request as soon as it has it

        def prefill() -> None:
            engine.add(prompts(1, point.tokens)[0], 1)
            run_out(engine)

        return profile_window(engine, label, prefill, top)
    warm, steps = window_shape(decode_tokens)
    for ids in prompts(point.batch, point.context):
        engine.add(ids, 1 + decode_tokens)
    step_until_all_hold(engine, {}, point.batch, 1 + warm)
    try:
        return profile_window(engine, label, lambda: run_steps(engine, steps), top)
    finally:
        run_out(engine)


class PointProfiler:
    """Profiles the points of one child within its time limit (``deadline``, a ``time.time()`` value)."""

    def __init__(self, engine, prompts: PromptMaker, decode_tokens: int, top: int, deadline: float) -> None:
        self.engine, self.prompts, self.decode_tokens = engine, prompts, decode_tokens
        self.top, self.deadline = top, deadline
        self.skipping: str | None = None

    def skip_reason(self, needs_s: float) -> str | None:
        """Why a profile that needs about ``needs_s`` seconds is not run, or None; once one is skipped for time,
        every later one is too (the run's order stays the same)."""
        left = self.deadline - time.time()
        if self.skipping is None and left < needs_s + RESERVE_S:
            self.skipping = f"skipped: {left:.0f} s left of the child's limit, a profile needs about {needs_s:.0f} s"
        return self.skipping

    def _guarded(self, needs_s: float, profile: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        skipped = self.skip_reason(needs_s)
        if skipped:
            return {"skipped": skipped}
        started = time.time()
        try:
            result = profile()
        except Exception as exc:  # a failed profile leaves the timed figure standing
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        return {**result, "profile_s": time.time() - started}

    def profile(self, point: Point, row: dict[str, Any]) -> dict[str, Any]:
        """A timed prefill or ``generate`` point, once more: about half its timing's run time (the timing made
        two or four runs of the same shape) plus the trace's handling."""
        needs = row.get("measure_s", 0.0) / 2 + TRACE_ALLOWANCE_S

        def work() -> dict[str, Any]:
            return profile_point(point, self.engine, self.prompts, self.decode_tokens, self.top)

        return self._guarded(needs, work)

    def after_window(self, point: Point, row: dict[str, Any]) -> Callable[[], None]:
        """For a stream point: the callback that profiles P steps once its timed window has closed."""

        def next_steps() -> None:
            run_steps(self.engine, PROFILE_STEPS)

        def work() -> dict[str, Any]:
            return profile_window(self.engine, trace_label(point), next_steps, self.top)

        def profile_next_steps() -> None:
            row["profile"] = self._guarded(2 * TRACE_ALLOWANCE_S, work)

        return profile_next_steps
