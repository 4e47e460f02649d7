"""One layer's routed experts as the host keeps them: checkpoint form, pinned on CUDA, read by the GPU in place.

The store holds ``rows`` experts (all of the layer's, or only those not resident on the GPU) and a device table
``row_of_expert [E]``: the store row of each expert, -1 for an expert the store does not hold. A store of every
expert is what a checkpoint loaded into host memory gives (a re-balance only copies host -> GPU). A store of only
the offloaded experts is what a host too small for all of them needs (V4-Flash's 147 GB of routed experts beside
128 GiB of RAM): a re-balance then swaps, writing each expert that leaves the GPU into the row of the one that
enters it.

On CUDA the copy kernel reads the store through :attr:`HostStore.sources`: for each part, a CUDA tensor aliasing the
pinned memory (unified virtual addressing gives pinned memory one address on the host and the GPU), viewed as one
row of words per expert. On the CPU the sources are the store's own tensors.
"""

from __future__ import annotations

import torch

from dsinfer.ops.expert_fetch import as_rows
from dsinfer.ops.moe import ExpertWeights

PARTS = ("w13", "w13_scale", "w2", "w2_scale")


def device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor of ``host``'s (pinned) bytes, same shape and dtype, that kernels read over PCIe in place."""
    from dsinfer.engram.fetch.host_memory import host_tensor, is_page_locked

    if not is_page_locked(host):
        raise ValueError("a host store read in place by the GPU must be pinned memory")
    alias = host_tensor(host.data_ptr(), host.numel() * host.element_size(), device)
    return alias.view(host.dtype).view(host.shape)


def pinned_weights(weights: ExpertWeights, device: torch.device) -> ExpertWeights:
    """``weights`` in page-locked host memory ``device`` reads (each part copied once unless it is pinned already;
    a copy takes exactly its bytes, see :func:`~dsinfer.engram.fetch.host_memory.registered_empty`)."""
    from dsinfer.engram.fetch.host_memory import is_page_locked, registered_empty

    def pinned(part: torch.Tensor | None) -> torch.Tensor | None:
        if part is None or is_page_locked(part):
            return part
        return registered_empty(tuple(part.shape), part.dtype, device).copy_(part)

    parts = [pinned(getattr(weights, name)) for name in PARTS]
    return ExpertWeights(*parts, weights.intermediate_size, weights.is_fp4)


class HostStore:
    """A layer's experts in host memory: ``weights`` (rows in checkpoint form) and ``row_of_expert`` on ``device``."""

    def __init__(self, weights: ExpertWeights, experts_held: list[int], num_experts: int, device) -> None:
        if weights.num_experts != len(experts_held):
            raise ValueError(f"{weights.num_experts} stored rows for {len(experts_held)} experts")
        device = torch.device(device)
        if device.type == "cuda":
            weights = pinned_weights(weights, device)
        self.weights, self.num_experts, self.device = weights, num_experts, device
        self.row_list = [-1] * num_experts  # the host's mirror of row_of_expert (read between steps)
        for row, expert in enumerate(experts_held):
            self.row_list[expert] = row
        self.row_of_expert = torch.tensor(self.row_list, dtype=torch.int64, device=device)
        self.sources = [self._source(getattr(weights, name)) for name in PARTS]

    @property
    def holds_every_expert(self) -> bool:
        return self.weights.num_experts == self.num_experts

    def _source(self, part: torch.Tensor | None) -> torch.Tensor | None:
        if part is None:
            return None
        rows = as_rows(part)
        return device_alias(rows, self.device) if self.device.type == "cuda" else rows

    def write_back(self, experts: list[int], rows: list[int], arena: ExpertWeights, entries: list[int]) -> None:
        """Store the device copies of ``experts`` (arena ``entries``) in host ``rows`` (between steps)."""
        for name in PARTS:  # row by row, device to the (page-locked) host rows: DMA, in the stream's order
            host = getattr(self.weights, name)
            if host is not None:
                device_part = getattr(arena, name)
                for entry, row in zip(entries, rows, strict=True):
                    host[row].copy_(device_part[entry], non_blocking=True)
        for expert, row in zip(experts, rows, strict=True):
            self.row_list[expert] = row

    def forget(self, experts: list[int]) -> None:
        """The store no longer holds ``experts`` (their rows were reused by :meth:`write_back`)."""
        for expert in experts:
            self.row_list[expert] = -1

    def publish(self) -> None:
        """Copy the host mirror into the device table (in place: captured steps read the same tensor)."""
        self.row_of_expert.copy_(torch.tensor(self.row_list, dtype=torch.int64))
