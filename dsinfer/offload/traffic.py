"""Expert-offload traffic as the metrics show it, read from the device counters without waiting for the device.

The arena's counters (:class:`~dsinfer.offload.arena.ExpertArena`) live on the device, where eager and captured
steps add to them. Reading them with ``tolist()`` would make the host wait for the step in flight, which overlap
scheduling must never do. :class:`TrafficReader` instead copies them into pinned host memory on the stream
(``non_blocking``), records an event, and hands out the last copy whose event has completed: each call costs an
event query and, when the previous copy has landed, one small copy launch. The numbers lag the device by at most
one call, so the engine reads them with every report it sends and once more while idle (the last step's
counts still arrive). On the CPU the counters are plain memory and are read as they are.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class OffloadTraffic:
    """Expert-offload counters of one engine (summed over its ranks): totals since the start, and the split."""

    reads: int = 0  # expert reads: one per expert a layer's step chose
    gpu_reads: int = 0  # of them, served by experts resident on the GPU
    fetched_experts: int = 0  # experts copied host -> GPU (misses and fetches ahead)
    fetched_ahead: int = 0  # of them, fetched ahead for the next layer
    copied_bytes: int = 0  # bytes those copies moved host -> GPU (PCIe on CUDA)
    resident_experts: int = 0  # experts kept on the GPU, over all offloaded layers
    offloaded_experts: int = 0  # experts kept in host memory only, over all offloaded layers

    @staticmethod
    def total(parts: Iterable[OffloadTraffic | None]) -> OffloadTraffic | None:
        """The sum of the ranks' traffic (None when no rank offloads experts)."""
        present = [part for part in parts if part is not None]
        if not present:
            return None
        names = [field.name for field in fields(OffloadTraffic)]
        return OffloadTraffic(**{name: sum(getattr(part, name) for part in present) for name in names})


class TrafficReader:
    """The device counters of one arena, read on the host without a synchronisation (see the module)."""

    def __init__(self, counters: torch.Tensor, expert_bytes: int, resident: int, offloaded: int) -> None:
        self.counters, self.expert_bytes = counters, expert_bytes
        self.resident, self.offloaded = resident, offloaded
        on_cuda = counters.device.type == "cuda"
        self._landing = torch.zeros(counters.shape, dtype=counters.dtype, pin_memory=on_cuda) if on_cuda else None
        self._copied: torch.cuda.Event | None = None
        self._latest = [0] * counters.numel()
        self._lock = threading.Lock()  # the engine thread and the server's event loop both read an engine's load

    def poll(self) -> OffloadTraffic:
        """The newest counts the host can read now (CUDA: as of the last completed copy; starts the next)."""
        if self._landing is None:
            return self._traffic(self.counters.tolist())
        with self._lock:
            if self._copied is not None and self._copied.query():
                self._latest, self._copied = self._landing.tolist(), None
            if self._copied is None:
                self._landing.copy_(self.counters, non_blocking=True)  # on the counters' device's current stream
                self._copied = torch.cuda.Event()
                self._copied.record(torch.cuda.current_stream(self.counters.device))
            return self._traffic(self._latest)

    def _traffic(self, counts: list[int]) -> OffloadTraffic:
        reads, gpu_reads, fetched, ahead = counts
        return OffloadTraffic(reads, gpu_reads, fetched, ahead, fetched * self.expert_bytes,
                              self.resident, self.offloaded)  # fmt: skip


def poll_offload_traffic(model) -> OffloadTraffic | None:
    """``model``'s expert-offload traffic without waiting for the device; None when it offloads no experts."""
    offload = getattr(model, "expert_offload", None)
    return None if offload is None else offload.poll_traffic()
