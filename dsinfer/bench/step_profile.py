"""Where a step's device time goes: the spans of its kernels and copies (from ``torch.profiler``) summed per step,
the idle time between them, and the largest gaps.

A sweep's decode point at one request takes longer than the model's graph alone (the sampler's kernels, the
step's input copies and the token read-back run beside it, and the host must launch each step in time): with
``--profile-steps N`` the sweep profiles N more steps after its timed ones and keeps this summary in the point's
record. On a CUDA device the spans are the device's kernels and copies; on the CPU, the top-level torch ops.
A profiler session leaves the process slower for a while (graph replays after one ran measurably slower on the
H200: docs/perf.md, history, pass 11), so a sweep that profiles should time one point: later points would read slow.

The engine runs its steps on the device worker's thread (:mod:`dsinfer.engine.device_worker`), which exists
before any profiler session. PyTorch's profiler records only the thread it was started in unless told to record
them all: on the CPU the ops of such a worker thread are missing from a session (tested). So every session here
records all threads. Graphed steps need one thing more: CUPTI sees the kernels of a CUDA graph's replays only
when the graph was instantiated while it was recording, so the sweep records its graphs again at the start of the
session (``prepare``) and leaves that recording out of the summary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Span = tuple[float, float, str]  # start and end (microseconds), name


def timeline_summary(spans: list[Span], steps: int = 1, top: int = 15, gaps_listed: int = 10) -> dict:
    """``spans`` of ``steps`` steps summed up: ``kernels`` (count), ``span_ms`` (first start to last end),
    ``busy_ms`` (summed durations), ``idle_ms`` (time no span covered between the first and the last), each also
    per step; the ``top`` names by time (ms and calls a step) and the ``gaps_listed`` largest gaps with the spans
    on either side."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if not spans:
        return {"kernels": 0, "steps": steps}
    spans = sorted(spans)
    gaps, end = [], spans[0][1]
    for (_, _, before), (start, stop, after) in zip(spans, spans[1:], strict=False):
        gaps.append((max(0.0, start - end), before, after))  # after everything so far has ended
        end = max(end, stop)
    gaps.sort(key=lambda gap: gap[0], reverse=True)
    by_name: dict[str, list[float]] = {}
    for start, stop, name in spans:
        by_name.setdefault(name, []).append(stop - start)
    ranked = sorted(((sum(times), len(times), name) for name, times in by_name.items()), reverse=True)
    span_ms = (max(stop for _, stop, _ in spans) - spans[0][0]) / 1e3
    busy_ms = sum(stop - start for start, stop, _ in spans) / 1e3
    idle_ms = sum(gap for gap, _, _ in gaps) / 1e3
    return {
        "kernels": len(spans),
        "steps": steps,
        "span_ms": span_ms,
        "busy_ms": busy_ms,
        "idle_ms": idle_ms,
        "per_step": {
            "kernels": len(spans) / steps,
            "span_ms": span_ms / steps,
            "busy_ms": busy_ms / steps,
            "idle_ms": idle_ms / steps,
        },
        "top": [
            {"ms_per_step": round(total / 1e3 / steps, 4), "calls_per_step": calls / steps, "name": name[:140]}
            for total, calls, name in ranked[:top]
        ],
        "gaps": [
            {"us": round(gap, 2), "before": before[:80], "after": after[:80]}
            for gap, before, after in gaps[:gaps_listed]
        ],
    }


PROFILED_MARK = "dsinfer.profiled_steps"  # a host event: spans before it belong to the session's preparation


def profiled_spans(
    run: Callable[[], None],
    device: torch.device,
    prepare: Callable[[], None] | None = None,
    drain: Callable[[], None] | None = None,
) -> list[Span]:
    """Run ``run`` under ``torch.profiler``, every thread recorded (see the module docstring): the device's kernel
    and copy spans on CUDA (the device drained before the session and at its end), the top-level torch ops
    elsewhere. ``prepare`` runs first inside the same session (recording CUDA graphs the profiler should see into,
    :func:`profile_steps`); what it ran is left out. ``drain``: how to wait for the launched work (default: the
    device's synchronize; an engine's steps reach the device from its worker thread, which
    :func:`dsinfer.bench.sweep_timing.drain_device` waits for too)."""
    from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile, record_function

    from dsinfer.bench.sweep_timing import synchronize

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if drain is None:
        drain = lambda: synchronize(device)  # noqa: E731
    drain()  # work launched before the session (a step launched ahead) is not ``run``'s
    with profile(activities=activities, experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        if prepare is not None:
            prepare()
            drain()
        with record_function(PROFILED_MARK):
            pass
        run()
        drain()
    events = prof.events()
    begin = max((event.time_range.end for event in events if event.name == PROFILED_MARK), default=float("-inf"))

    def wanted(event) -> bool:
        if event.time_range.start < begin:
            return False
        if cuda:
            return event.device_type == torch.autograd.DeviceType.CUDA
        return event.cpu_parent is None and event.name.startswith("aten::")

    return [(event.time_range.start, event.time_range.end, event.name) for event in events if wanted(event)]


def laid_end_to_end(sessions: list[list[Span]]) -> list[Span]:
    """The spans of separate profiler sessions as one timeline, each session shifted to start where the one before
    ended: :func:`timeline_summary` then sums the sessions' spans and idle time, and leaves out whatever ran
    between them (unprofiled steps)."""
    joined: list[Span] = []
    end = 0.0
    for spans in sessions:
        if not spans:
            continue
        shift = end - min(start for start, _, _ in spans)
        joined += [(start + shift, stop + shift, name) for start, stop, name in spans]
        end = max(end, max(stop for _, stop, _ in spans) + shift)
    return joined


def profile_steps(
    step: Callable[[], None],
    steps: int,
    device: torch.device,
    top: int = 15,
    prepare: Callable[[], None] | None = None,
    drain: Callable[[], None] | None = None,
) -> dict:
    """:func:`timeline_summary` of ``steps`` calls of ``step`` (an engine step) profiled together. ``prepare``:
    what must run inside the session first and stay out of the summary; ``drain``: as :func:`profiled_spans`
    takes it. The kernels of a CUDA graph's replays reach the profiler only when the graph was instantiated while
    one was recording (CUPTI instruments a graph's kernels when it is instantiated), so a profile of graphed steps
    passes the engine's graph recapture here (:func:`dsinfer.bench.sweep_timing.recapture_graphs`)."""

    def run() -> None:
        for _ in range(steps):
            step()

    return timeline_summary(profiled_spans(run, device, prepare, drain), steps, top)
