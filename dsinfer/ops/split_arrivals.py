"""The arrival counts of split launches: kernels that split one output tile's work over several programs, where
the last program of a tile to finish adds the splits' partial sums in split order (deterministic, one launch, no
reduction kernel, CUDA-graph safe). Each tile has one int32 count, zero between launches: the last program sets
it back. Launches on one stream run one after another, so every split kernel on a device shares one buffer
(``fp8_linear``'s split-K kernels, ``routed_moe``'s down GEMV)."""

from __future__ import annotations

import torch

ARRIVAL_COUNTS: dict[torch.device, torch.Tensor] = {}
MAX_SPLIT_TILES = 1 << 14


def arrival_counts(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's tile counts, made (zeroed) on first use; None where they cannot be (too many tiles, or first
    needed while a CUDA graph is being captured, where a zeroing would only be recorded): the launch then runs
    unsplit."""
    counts = ARRIVAL_COUNTS.get(device)
    if counts is None:
        if tiles > MAX_SPLIT_TILES or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return None
        counts = ARRIVAL_COUNTS[device] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return counts if tiles <= counts.numel() else None
