"""Where a profiled window's time went: one reader of Chrome traces (torch.profiler / Kineto) for both engines.

vLLM's worker writes its trace (``LLM.start_profile`` / ``stop_profile``, gzipped) and dsinfer's child exports
its own with ``torch.profiler``; both are Chrome-trace JSON read here by :func:`summarize_trace`:

* device activity: GPU kernels, memory copies and memsets (Kineto's ``kernel``, ``gpu_memcpy``, ``gpu_memset``).
  Kernels replayed from a CUDA graph are recorded one by one on NVIDIA (they share the correlation id of their
  ``cudaGraphLaunch``); a trace with graph launches and none of their kernels says so in its note, since its
  device time then lacks them. A trace with no GPU activity (a CPU run) falls back to CPU operators by self time
  (their own time less that of the operators they called), which then stand in for kernels.
* steps: the engine's own per-step annotations (``user_annotation`` events whose name matches the engine's
  pattern: vLLM's worker writes ``execute_context_C(T)_generation_G(T)`` for each step it executes once its
  profiler exists; dsinfer's child wraps each ``step()`` in ``dsinfer_step``).
* the window: from the first device activity's start to the last one's end; per step: the window / steps.
  Busy: the union of the device intervals (overlapping streams count once); idle: the rest of the window, which
  is where the host kept the device waiting (the profiler's own host overhead included, so idle here is an upper
  bound; the table also sets the busy time against the unprofiled timed step).
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
GRAPH_LAUNCHES = {"cudaGraphLaunch", "cuGraphLaunch", "cudaGraphLaunch_v10000"}
VLLM_STEP_PATTERN = r"^execute_context_(?!0\(0\)_generation_0\(0\))"  # steps that ran some tokens
DSINFER_STEP_ANNOTATION = "dsinfer_step"
DSINFER_STEP_PATTERN = rf"^{DSINFER_STEP_ANNOTATION}$"


def load_trace_events(path: str | Path) -> list[dict[str, Any]]:
    """The ``traceEvents`` of a Chrome trace file, gzipped or not."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    return data["traceEvents"] if isinstance(data, dict) else data


def _interval(event: dict[str, Any]) -> tuple[float, float]:
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0.0))


def _complete(events: list[dict[str, Any]], categories: set[str]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in categories and "ts" in e]


def cpu_self_times(operators: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
    """Each CPU operator with its self time (microseconds): its duration less that of the operators it called
    directly, found by nesting the operators of each thread by their intervals."""
    by_thread: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for event in operators:
        by_thread[(event.get("pid"), event.get("tid"))].append(event)
    timed: list[tuple[dict[str, Any], float]] = []
    for events in by_thread.values():
        events.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))
        open_calls: list[list] = []  # [event, end, children's time]
        for event in events:
            start, end = _interval(event)
            while open_calls and open_calls[-1][1] <= start:
                done = open_calls.pop()
                timed.append((done[0], float(done[0].get("dur", 0.0)) - done[2]))
            if open_calls:
                open_calls[-1][2] += end - start
            open_calls.append([event, end, 0.0])
        timed += [(call[0], float(call[0].get("dur", 0.0)) - call[2]) for call in open_calls]
    return timed


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def count_steps(events: list[dict[str, Any]], step_pattern: str) -> int:
    """Host-side step annotations whose name matches ``step_pattern`` (GPU-side copies are not counted)."""
    pattern = re.compile(step_pattern)
    return sum(1 for e in _complete(events, {"user_annotation"}) if pattern.search(str(e.get("name", ""))))


def graph_replays(events: list[dict[str, Any]]) -> tuple[int, int]:
    """(CUDA graph launches, kernels recorded from them): a replayed kernel carries its launch's correlation id."""
    launches = [e for e in _complete(events, {"cuda_runtime", "cuda_driver"}) if e.get("name") in GRAPH_LAUNCHES]
    correlations = {(e.get("args") or {}).get("correlation") for e in launches} - {None}
    kernels = _complete(events, {"kernel"})
    return len(launches), sum(1 for e in kernels if (e.get("args") or {}).get("correlation") in correlations)


def device_activity(events: list[dict[str, Any]]) -> tuple[str, list[tuple[dict[str, Any], float]]]:
    """(what stands for the device, [(event, time in microseconds)]): GPU activity by duration, or where the
    trace has none, CPU operators by self time."""
    device = _complete(events, DEVICE_CATEGORIES)
    if device:
        return "gpu kernels", [(e, float(e.get("dur", 0.0))) for e in device]
    return "cpu ops (no GPU activity in the trace)", cpu_self_times(_complete(events, {"cpu_op"}))


def summarize_trace(events: list[dict[str, Any]], step_pattern: str, top: int = 15) -> dict[str, Any]:
    """Per step of the profiled window: its length, the device's busy time and share, and the ``top`` kernels
    (or CPU operators) by time, each with its calls, milliseconds and share of the step."""
    source, timed = device_activity(events)
    steps = count_steps(events, step_pattern)
    launches, from_graphs = graph_replays(events)
    summary: dict[str, Any] = {"source": source, "steps": steps, "graph_launches": launches}
    summary["graph_kernels"] = from_graphs
    if not timed:
        note = "no device activity recorded"
        if launches:
            note += f"; {launches} CUDA graph launches, the kernels inside them were not recorded"
        return {**summary, "note": note, "top": []}
    if launches and not from_graphs:
        summary["note"] = f"the kernels inside {launches} CUDA graph launches were not recorded (not in device time)"
    intervals = [_interval(event) for event, _ in timed]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    per_step = max(steps, 1)
    if not steps:
        summary["note"] = "; ".join(filter(None, [summary.get("note"), "no step annotations: figures for the window"]))
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event, micros in timed:
        entry = by_name[str(event.get("name", "?"))]
        entry[0] += 1
        entry[1] += micros
    step_ms, busy = span / 1e3 / per_step, busy_time(intervals)
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])
    total = sum(micros for _, micros in by_name.values())
    summary.update(
        window_ms=span / 1e3,
        step_ms=step_ms,
        busy_ms_per_step=busy / 1e3 / per_step,
        busy_share=busy / span if span > 0 else 1.0,
        device_ms_per_step=total / 1e3 / per_step,
        distinct=len(by_name),
        calls_per_step=sum(calls for calls, _ in by_name.values()) / per_step,
        top=[
            {
                "name": name,
                "calls": calls,
                "calls_per_step": calls / per_step,
                "ms_per_step": micros / 1e3 / per_step,
                "share": micros / 1e3 / per_step / step_ms if step_ms > 0 else 0.0,
            }
            for name, (calls, micros) in ranked[:top]
        ],
        rest_ms_per_step=sum(micros for _, (_, micros) in ranked[top:]) / 1e3 / per_step,
    )
    return summary


def short_kernel_name(name: str, width: int = 64) -> str:
    """A kernel name for a table cell: no ``void``, no argument list, at most ``width`` characters."""
    name = name.removeprefix("void ").strip()
    if name.endswith(")") and "(" in name:
        depth = 0
        for index in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[index], 0)
            if depth == 0:
                name = name[:index] or name
                break
    name = name.replace("|", "/")
    return name if len(name) <= width else name[: width - 3] + "..."
