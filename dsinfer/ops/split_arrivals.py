"""The arrival counts of split launches: kernels that split one output tile's work over several programs, where
the last program of a tile to finish adds the splits' partial sums in split order (deterministic, one launch, no
reduction kernel, CUDA-graph safe). Each tile has one int32 count, zero between launches: the last program sets
it back. Launches on one stream run one after another, so every split kernel of a stream shares one buffer
(``fp8_linear``'s split-K kernels, ``routed_moe``'s down GEMV). Work on the side stream
(:mod:`dsinfer.ops.side_stream`) runs beside the current stream's, so it takes a buffer of its own: its lane."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

ARRIVAL_COUNTS: dict[tuple[torch.device, str], torch.Tensor] = {}
MAX_SPLIT_TILES = 1 << 14
MAIN_LANE = "main"
_current = threading.local()


@contextmanager
def arrival_lane(lane: str) -> Iterator[None]:
    """Split launches inside take lane ``lane``'s counts (the calling thread only); outside, :data:`MAIN_LANE`'s."""
    outer = getattr(_current, "lane", MAIN_LANE)
    _current.lane = lane
    try:
        yield
    finally:
        _current.lane = outer


def current_lane() -> str:
    return getattr(_current, "lane", MAIN_LANE)


def arrival_counts(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's tile counts for the current lane, made (zeroed) on first use; None where they cannot be (too
    many tiles, or first needed while a CUDA graph is being captured, where a zeroing would only be recorded): the
    launch then runs unsplit."""
    key = (device, current_lane())
    counts = ARRIVAL_COUNTS.get(key)
    if counts is None:
        if tiles > MAX_SPLIT_TILES or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return None
        counts = ARRIVAL_COUNTS[key] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return counts if tiles <= counts.numel() else None
