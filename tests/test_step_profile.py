"""``dsinfer.bench.step_profile.timeline_summary``: the arithmetic of a step's spans (busy, span, idle, per step,
costliest names, largest gaps), overlapping spans included."""

from __future__ import annotations

import pytest

from dsinfer.bench.step_profile import laid_end_to_end, timeline_summary


def test_spans_of_two_steps():
    spans = [  # microseconds; "b" overlaps "a", then a 30 us gap, then the second step
        (0.0, 100.0, "a"),
        (50.0, 120.0, "b"),
        (150.0, 160.0, "c"),
        (400.0, 500.0, "a"),
        (500.0, 520.0, "c"),
    ]
    summary = timeline_summary(list(reversed(spans)), steps=2, top=2, gaps_listed=2)
    assert summary["kernels"] == 5 and summary["steps"] == 2
    assert summary["span_ms"] == pytest.approx(0.52)
    assert summary["busy_ms"] == pytest.approx((100 + 70 + 10 + 100 + 20) / 1e3)
    assert summary["idle_ms"] == pytest.approx((30 + 240) / 1e3)  # the overlap is not idle time
    assert summary["per_step"]["busy_ms"] == pytest.approx(summary["busy_ms"] / 2)
    assert summary["top"][0] == {"ms_per_step": 0.1, "calls_per_step": 1.0, "name": "a"}
    assert summary["top"][1]["name"] == "b" and len(summary["top"]) == 2
    assert [gap["us"] for gap in summary["gaps"]] == [240.0, 30.0]
    assert summary["gaps"][0]["before"] == "c" and summary["gaps"][0]["after"] == "a"


def test_no_spans_and_bad_steps():
    assert timeline_summary([], steps=3) == {"kernels": 0, "steps": 3}
    with pytest.raises(ValueError, match="steps"):
        timeline_summary([(0.0, 1.0, "a")], steps=0)


def test_sessions_laid_end_to_end_leave_out_the_time_between_them():
    """Two steps profiled in sessions of their own, 10 ms apart (unprofiled steps ran between): their summary's
    span and idle time are the two sessions' own, not the wall time from the first to the second."""
    first = [(1000.0, 1100.0, "a"), (1130.0, 1150.0, "b")]  # 150 us, 30 idle
    second = [(11000.0, 11040.0, "a"), (11060.0, 11100.0, "b")]  # 100 us, 20 idle
    summary = timeline_summary(laid_end_to_end([first, [], second]), steps=2)
    assert summary["span_ms"] == pytest.approx(0.25)
    assert summary["idle_ms"] == pytest.approx(0.05)
    assert summary["busy_ms"] == pytest.approx(0.2) and summary["kernels"] == 4
    assert laid_end_to_end([]) == []
