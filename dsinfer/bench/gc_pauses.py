"""The Python garbage collector's pauses inside a timed window: collections of each generation, and their time.

A collection runs in whichever thread allocates when a threshold is crossed, so one can land inside a timed
engine step; a step of a millisecond or two then reads several times its usual length. The sweep records these
beside its step times, so an outlier can be told apart from the device's or the scheduler's.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """``with GcPauses() as pauses:`` ... ``pauses.summary()``: the collections that ran inside the block."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds)
        self._started: float | None = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._observe)

    def _observe(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.pauses.append((info["generation"], time.perf_counter() - self._started))
            self._started = None

    def summary(self) -> dict[str, Any]:
        """Collections per generation (0, 1, 2), their total and longest time in ms."""
        seconds = [s for _, s in self.pauses]
        return {
            "collections": [sum(1 for generation, _ in self.pauses if generation == g) for g in range(3)],
            "ms": 1e3 * sum(seconds),
            "longest_ms": 1e3 * max(seconds, default=0.0),
        }
