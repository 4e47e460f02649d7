"""The device's expert slots and each offloaded layer's expert -> slot table.

One :class:`ExpertArena` holds, stacked in one :class:`~dsinfer.ops.moe.ExpertWeights` (so the ``routed_moe`` op
reads it like any layer's experts): every offloaded layer's resident slots, then ``FETCH_BUFFERS`` fetch buffers
shared by all layers, each with room for one layer's non-resident experts. A :class:`LayerResidency` keeps its
layer's experts in host memory in checkpoint form (the host store: on CUDA pinned, on the CPU the same memory as
the "device") and a table ``slot_of_expert [E]``: the arena entry of each resident expert, -1 for the others.

Before the layer's op runs, :meth:`LayerResidency.stage` counts the router's choices, copies the chosen experts
that are not resident into the next fetch buffer, and returns the table for this call (the resident entries plus
the fetched ones). The op reads every expert through it; its reference runs experts in id order whatever their
slots, so offloading never changes a bit of the output. Between steps :meth:`LayerResidency.rebalance` makes the
most-routed experts resident.

Limits, said plainly: finding the misses reads the chosen ids on the host (one synchronisation per offloaded layer
and step), so a decode step with offloaded layers is not capturable in a CUDA graph, and the copies wait on the
compute stream; a device-side miss list with copies on a side stream (the look-ahead the plan's two buffers are
sized for) is the next step.
"""

from __future__ import annotations

import torch

from dsinfer.config.expert_split import FETCH_BUFFERS
from dsinfer.offload.stats import ExpertStats
from dsinfer.ops.moe import ExpertWeights

_PARTS = ("w13", "w13_scale", "w2", "w2_scale")


def _empty_like_rows(weights: ExpertWeights, rows: int, device: torch.device | str) -> ExpertWeights:
    def empty(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=device)

    parts = [empty(getattr(weights, name)) for name in _PARTS]
    return ExpertWeights(*parts, weights.intermediate_size, weights.is_fp4)


class ExpertArena:
    """Resident slots of every offloaded layer, then the shared fetch buffers, as one stack of expert weights."""

    def __init__(self, like: ExpertWeights, layers: int, resident: int, fetch_slots: int, device) -> None:
        self.layers, self.resident, self.fetch_slots = layers, resident, fetch_slots
        self.weights = _empty_like_rows(like, layers * resident + FETCH_BUFFERS * fetch_slots, device)
        self._next_buffer = 0
        self.fetched_experts = 0  # experts copied in on a miss, since the start (PCIe traffic on CUDA)
        self.served_experts = 0  # experts the layers read, resident or fetched

    def resident_rows(self, row: int) -> range:
        """Arena entries of the resident slots of the offloaded layer at ``row``."""
        return range(row * self.resident, (row + 1) * self.resident)

    def take_fetch_buffer(self) -> int:
        """First arena entry of the next fetch buffer (round robin)."""
        start = self.layers * self.resident + self._next_buffer * self.fetch_slots
        self._next_buffer = (self._next_buffer + 1) % FETCH_BUFFERS
        return start

    def copy_in(self, entries: torch.Tensor, host: ExpertWeights, experts: torch.Tensor) -> None:
        """Copy ``host``'s ``experts`` into arena ``entries`` (host -> device; non-blocking from pinned memory)."""
        host_ids = experts.to(host.w13.device)
        for name in _PARTS:
            target = getattr(self.weights, name)
            if target is not None:
                rows = getattr(host, name).index_select(0, host_ids)
                target.index_copy_(0, entries.to(target.device), rows.to(target.device, non_blocking=True))


class LayerResidency:
    """One offloaded layer: its host store, its arena rows and its expert -> arena entry table."""

    def __init__(self, row: int, host: ExpertWeights, arena: ExpertArena, stats: ExpertStats) -> None:
        self.row, self.host, self.arena, self.stats = row, host, arena, stats
        device = arena.weights.w13.device
        self.slot_of_expert = torch.full((host.num_experts,), -1, dtype=torch.int64, device=device)
        self.resident: list[int] = []
        self.before_step = None  # the first offloaded layer's hook: a step starts (ExpertOffload.before_step)
        self.rebalance()

    def stage(self, expert_ids: torch.Tensor) -> tuple[ExpertWeights, torch.Tensor]:
        """Count this step's choices, fetch the chosen experts that are not resident; the arena and the table
        every chosen expert can be read through."""
        if self.before_step is not None:
            self.before_step()
        self.stats.record(self.row, expert_ids)
        chosen = torch.unique(expert_ids)
        missing = chosen[self.slot_of_expert[chosen] < 0]
        self.arena.served_experts += chosen.numel()
        if missing.numel() == 0:
            return self.arena.weights, self.slot_of_expert
        if missing.numel() > self.arena.fetch_slots:
            raise RuntimeError(f"{missing.numel()} experts missed but a fetch buffer has {self.arena.fetch_slots}")
        start = self.arena.take_fetch_buffer()
        entries = torch.arange(start, start + missing.numel(), device=self.slot_of_expert.device)
        self.arena.copy_in(entries, self.host, missing)
        self.arena.fetched_experts += missing.numel()
        table = self.slot_of_expert.clone()
        table[missing] = entries
        return self.arena.weights, table

    def rebalance(self) -> int:
        """Make the layer's most-routed experts resident (between steps); how many experts moved in."""
        wanted = self.stats.resident(self.row, self.arena.resident)
        staying = set(wanted) & set(self.resident)
        leaving = [e for e in self.resident if e not in staying]
        entering = [e for e in wanted if e not in staying]
        free = [self.slot_of_expert[e].item() for e in leaving]
        free += list(self.arena.resident_rows(self.row))[len(self.resident) :]  # first fill: every slot is free
        if entering:
            device = self.slot_of_expert.device
            entries = torch.tensor(free[: len(entering)], dtype=torch.int64, device=device)
            ids = torch.tensor(entering, dtype=torch.int64, device=device)
            self.arena.copy_in(entries, self.host, ids)
            self.slot_of_expert[torch.tensor(leaving, dtype=torch.int64, device=device)] = -1
            self.slot_of_expert[ids] = entries
        self.resident = sorted(staying | set(entering))
        return len(entering)
