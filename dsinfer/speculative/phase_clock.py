"""How a graphed speculative step's device time splits between its two replays: the verify graph (snapshot,
target forward over the K + 1 positions, judge) and the draft graph (rollback, the drafter's next drafts).

A benchmark turns it on (:meth:`~dsinfer.speculative.graphs.SpecGraphs.start_phase_clock`); serving never does.
On CUDA three timing events a step are recorded on the stream around the replays and read after the step's one
host read, when they have completed; on the CPU the parts run synchronously and the host clock times them.
"""

from __future__ import annotations

import statistics
import time

import torch


class PhaseClock:
    """Milliseconds of the verify and the draft replay of every step timed, read as medians."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.laps: list[tuple[float, float]] = []  # (verify ms, draft ms) a step
        self._marks: list = []

    def mark(self) -> None:
        """Before the verify replay, between the replays, after the draft replay."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def close_step(self) -> None:
        """After the step's host read: its three marks become one lap (a step without all three is dropped)."""
        marks, self._marks = self._marks, []
        if len(marks) != 3:
            return
        if self.cuda:
            self.laps.append((marks[0].elapsed_time(marks[1]), marks[1].elapsed_time(marks[2])))
        else:
            self.laps.append(((marks[1] - marks[0]) * 1e3, (marks[2] - marks[1]) * 1e3))

    def medians(self) -> dict[str, float] | None:
        """``verify_ms`` and ``draft_ms``, medians over the steps timed; None before any."""
        if not self.laps:
            return None
        return {"verify_ms": statistics.median(lap[0] for lap in self.laps),
                "draft_ms": statistics.median(lap[1] for lap in self.laps), "steps": len(self.laps)}  # fmt: skip
