"""The device's expert slots: every offloaded layer's resident experts, then the fetch buffers, as one stack.

One :class:`ExpertArena` holds, stacked in one :class:`~dsinfer.ops.moe.ExpertWeights` (so the ``routed_moe`` op
reads it like any layer's experts): every offloaded layer's ``resident`` slots, then ``FETCH_BUFFERS`` fetch
buffers of ``fetch_slots`` rows. Layer ``row`` fetches into buffer ``row % FETCH_BUFFERS``, so layer ``l + 1``'s
misses can be copied in (on the copy stream) while layer ``l`` still reads its own; a buffer has one row per
expert the layer does not keep resident, so no step can miss more experts than it holds.

The arena also keeps the traffic counters on the device (a captured step adds to them like an eager one), read
on the host only for metrics: expert reads, reads served by resident experts, experts copied in, and of them
those copied ahead (predicted for the next layer).
"""

from __future__ import annotations

import torch

from dsinfer.config.expert_split import FETCH_BUFFERS
from dsinfer.engram.fetch.host_memory import registered_empty
from dsinfer.offload.host_store import PARTS
from dsinfer.ops.moe import ExpertWeights

READS, GPU_READS, FETCHED, FETCHED_AHEAD = range(4)  # the counters' entries (FETCHED counts both kinds)


def empty_like_rows(weights: ExpertWeights, rows: int, device, mapped_for: torch.device | None = None) -> ExpertWeights:
    """``rows`` experts of ``weights``' layout, uninitialised, on ``device``; with ``mapped_for`` (a CUDA device) in
    page-locked host memory that device reads in place (what a host store is), each part of its exact size."""

    def empty(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        shape = (rows, *tensor.shape[1:])
        if mapped_for is not None:  # not torch's pinned allocator: it rounds every part up to a power of two
            return registered_empty(shape, tensor.dtype, mapped_for)
        return torch.empty(shape, dtype=tensor.dtype, device=device)

    parts = [empty(getattr(weights, name)) for name in PARTS]
    return ExpertWeights(*parts, weights.intermediate_size, weights.is_fp4)


class ExpertArena:
    """Resident slots of every offloaded layer, then the shared fetch buffers, as one stack of expert weights."""

    def __init__(self, like: ExpertWeights, layers: int, resident: int, fetch_slots: int, device) -> None:
        self.layers, self.resident, self.fetch_slots = layers, resident, fetch_slots
        self.device = torch.device(device)
        self.weights = empty_like_rows(like, layers * resident + FETCH_BUFFERS * fetch_slots, device)
        self.expert_bytes = like.nbytes // like.num_experts
        self.counters = torch.zeros(4, dtype=torch.int64, device=device)
        # Fetch-ahead copies run here on CUDA (created before any graph capture needs it); the CPU has one order.
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def resident_rows(self, row: int) -> range:
        """Arena entries of the resident slots of the offloaded layer at ``row``."""
        return range(row * self.resident, (row + 1) * self.resident)

    def fetch_rows(self, row: int) -> range:
        """Arena entries of the fetch buffer the offloaded layer at ``row`` copies its misses into."""
        start = self.layers * self.resident + (row % FETCH_BUFFERS) * self.fetch_slots
        return range(start, start + self.fetch_slots)

    def copy_rows(self, copy, host, source_rows: torch.Tensor, target_rows: torch.Tensor) -> None:
        """``copy`` (the ``copy_expert_rows`` op) of every part: host rows ``source_rows`` into arena entries."""
        for name, source in zip(PARTS, host.sources, strict=True):
            if source is not None:
                target = getattr(self.weights, name)
                copy(source, target.view(target.shape[0], -1).view(source.dtype), source_rows, target_rows)

    def counts(self) -> dict[str, int]:
        """The counters on the host (a synchronisation: metrics and tests only)."""
        reads, gpu_reads, fetched, ahead = self.counters.tolist()
        return {"reads": reads, "gpu_reads": gpu_reads, "fetched": fetched, "fetched_ahead": ahead}

    @property
    def fetched_experts(self) -> int:
        """Experts copied host -> device for the layers' reads since the start (PCIe traffic on CUDA)."""
        return self.counts()["fetched"]

    @property
    def served_experts(self) -> int:
        """Expert reads of the layers (one per expert a layer's step chose), resident or fetched."""
        return self.counts()["reads"]
