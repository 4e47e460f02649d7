"""ITL of ``dsinfer bench serve`` split by whether another request was being prefilled, seen from the client.

A serving engine that batches prefill chunks into decode steps makes some steps longer than a pure decode step;
the pooled ITL mixes both kinds. The split here needs nothing from the server:

* a request is *prefilling* from its send time until its first text chunk arrives: the half-open interval
  ``[start_s, start_s + ttft_s)``; a request that never got a first token (errored or incomplete before any
  text) counts as prefilling from its send time to its end, ``[start_s, end_s)``;
* each ITL gap of a successful stream is the interval ``(t_prev, t_cur]`` between two text chunks; it is
  *decode-only* when no request of the run was prefilling at any time inside it, and *with-prefill* otherwise.
  Intervals that only touch count as apart: a prefill whose first token came at ``t_prev`` ended with the step
  that delivered ``t_prev``'s chunk, and a request sent at ``t_cur`` cannot have slowed the step that delivered
  ``t_cur``'s chunk. A stream's own prefill ended at its first chunk, before all its gaps.

A gap of zero length (two chunks of one network read) lies at one instant: with-prefill when that instant is
strictly inside a prefill. The client's view is conservative: a request counts as prefilling while its prompt
waits in the server's queue too, so some decode-only steps are labelled with-prefill, never the reverse (as far
as send and first-token times bound the prefill).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np


class TimedRecord(Protocol):
    """What the split reads from a request record (``dsinfer.bench.serving_client.RequestRecord``)."""

    status: str
    start_s: float
    end_s: float
    ttft_s: float | None
    itl_s: list[float]


def prefill_intervals(records: Iterable[TimedRecord]) -> list[tuple[float, float]]:
    """``(send, first text chunk)`` of every request of the run, or ``(send, end)`` for one that got no text."""
    intervals = []
    for record in records:
        end = record.start_s + record.ttft_s if record.ttft_s is not None else record.end_s
        if end > record.start_s:
            intervals.append((record.start_s, end))
    return intervals


def merge(intervals: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Starts and ends of the union of the intervals, sorted; overlapping intervals are joined, touching ones
    kept apart (a gap of zero length at the instant where one ends and the next begins is inside neither)."""
    starts: list[float] = []
    ends: list[float] = []
    for start, end in sorted(intervals):
        if ends and start < ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    return np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)


def token_times(record: TimedRecord) -> np.ndarray:
    """Arrival times of a stream's text chunks (run clock): its first, then each ITL gap added on."""
    first = record.start_s + record.ttft_s
    return first + np.concatenate(([0.0], np.cumsum(np.asarray(record.itl_s, dtype=np.float64))))


def with_prefill_mask(gap_starts: np.ndarray, gap_ends: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """True for each gap ``(a, b]`` that some merged prefill interval ``[s, e)`` overlaps: ``s < b`` and ``e > a``.

    The first interval that ends after ``a`` is the only candidate: if it starts at or after ``b``, so do the
    rest, which start where it ends or later."""
    if not len(starts):
        return np.zeros(len(gap_starts), dtype=bool)
    index = np.searchsorted(ends, gap_starts, side="right")  # first interval with end > a
    found = index < len(ends)
    mask = np.zeros(len(gap_starts), dtype=bool)
    mask[found] = starts[index[found]] < gap_ends[found]
    return mask


def split_itl(records: list[TimedRecord]) -> tuple[list[float], list[float]]:
    """(decode-only gaps, with-prefill gaps) in seconds, over the successful streams' ITL gaps."""
    starts, ends = merge(prefill_intervals(records))
    decode_only: list[float] = []
    with_prefill: list[float] = []
    for record in records:
        if record.status != "successful" or not record.itl_s:
            continue
        times = token_times(record)
        gaps = np.asarray(record.itl_s, dtype=np.float64)
        mask = with_prefill_mask(times[:-1], times[1:], starts, ends)
        decode_only += gaps[~mask].tolist()
        with_prefill += gaps[mask].tolist()
    return decode_only, with_prefill
