"""The collector's pauses as the sweep records them, and the heap freeze a serving process applies."""

from __future__ import annotations

import gc

from dsinfer.bench.gc_pauses import GcPauses
from dsinfer.engine.gc_heap import freeze_heap, thaw_heap


def test_pauses_count_the_collections_inside_the_block_only():
    gc.collect()
    with GcPauses() as pauses:
        gc.collect(0)
        gc.collect(2)
    gc.collect(1)  # outside: not counted
    summary = pauses.summary()
    assert summary["collections"] == [1, 0, 1]
    assert summary["ms"] >= summary["longest_ms"] > 0
    assert GcPauses().summary() == {"collections": [0, 0, 0], "ms": 0.0, "longest_ms": 0.0}


def test_freeze_exempts_the_living_heap_and_thaw_returns_it():
    try:
        freeze_heap()
        assert gc.get_freeze_count() > 0
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0
