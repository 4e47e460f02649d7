"""Grouping a step's (token, k) slots by expert on the device, with shapes the host knows in advance.

A slot is one (token, choice) pair, numbered ``slot = token * k + choice``: the row-major flattening of the
router's ``expert_ids [T, k]``. Grouped GEMMs want the slots of each expert contiguous; block-M kernels also
want each expert's run padded to whole blocks so that a block never straddles two experts (the layout of
vLLM's ``moe_align_block_size``, written here in torch).

Why no host synchronisation: every tensor here has a size computed from ``T``, ``k``, ``E`` and ``BLOCK_M``
alone, and every data-dependent quantity (counts, offsets, the number of live blocks) stays a device tensor,
so a decode step that calls these can be captured in a CUDA graph. ``torch.bincount`` is avoided on purpose:
on CUDA it reads the input's maximum on the host to size its output, even with ``minlength``; counts are a
``scatter_add_`` into ``E`` zeros instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AlignedSlots", "SortedSlots", "align_slots", "max_aligned_blocks", "sort_slots"]


@dataclass(frozen=True)
class SortedSlots:
    """The step's slots ordered by expert (stable: within an expert, by slot, i.e. by token)."""

    slots: torch.Tensor  # int64 [T*k]: slot ids in expert order
    experts: torch.Tensor  # int64 [T*k]: the expert of each entry of ``slots`` (non-decreasing)
    counts: torch.Tensor  # int64 [E]: slots per expert
    offsets: torch.Tensor  # int64 [E + 1]: expert e's slots are ``slots[offsets[e] : offsets[e + 1]]``


@dataclass(frozen=True)
class AlignedSlots:
    """Slots in expert order with each expert's run padded to a multiple of ``block_m``.

    ``slot_ids[b * block_m : (b + 1) * block_m]`` all belong to expert ``block_expert[b]``; padding entries hold
    ``pad_slot`` (= T*k, one past the last slot). Blocks ``>= num_blocks[0]`` are unused: their ``block_expert``
    is -1 and all their slot ids are padding.
    """

    slot_ids: torch.Tensor  # int64 [max_blocks * block_m]
    block_expert: torch.Tensor  # int64 [max_blocks]
    num_blocks: torch.Tensor  # int64 [1], on the device
    expert_block_ends: torch.Tensor  # int64 [E]: expert e owns blocks [ends[e-1], ends[e]) (ends[-1] = 0)
    pad_slot: int
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.numel()


def sort_slots(expert_ids: torch.Tensor, num_experts: int) -> SortedSlots:
    """Order the slots of ``expert_ids [T, k]`` (int64) by expert, with per-expert counts and offsets."""
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids must be [T, k], got shape {tuple(expert_ids.shape)}")
    flat = expert_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    experts = flat.index_select(0, order)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    torch.cumsum(counts, dim=0, out=offsets[1:])
    return SortedSlots(order, experts, counts, offsets)


def max_aligned_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """Most blocks :func:`align_slots` can need: each of the (at most ``min(E, slots)``) experts present
    rounds its run up by fewer than ``block_m`` entries, so ``sum ceil(c_e / M) <= (slots + n (M - 1)) // M``."""
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    present = min(num_experts, num_slots)
    return (num_slots + present * (block_m - 1)) // block_m


def align_slots(sorted_slots: SortedSlots, block_m: int) -> AlignedSlots:
    """Pad each expert's run of ``sorted_slots`` to whole ``block_m`` blocks, all on the device."""
    num_slots = sorted_slots.slots.numel()
    num_experts = sorted_slots.counts.numel()
    device = sorted_slots.slots.device
    max_blocks = max_aligned_blocks(num_slots, num_experts, block_m)

    blocks_per_expert = (sorted_slots.counts + (block_m - 1)) // block_m
    block_ends = torch.cumsum(blocks_per_expert, dim=0)  # [E]
    padded_starts = (block_ends - blocks_per_expert) * block_m  # first padded position of each expert
    # Entry p of the sorted order is the (p - offsets[e])-th slot of its expert e.
    positions = torch.arange(num_slots, device=device)
    expert = sorted_slots.experts
    destination = padded_starts.index_select(0, expert) + positions - sorted_slots.offsets.index_select(0, expert)
    slot_ids = torch.full((max_blocks * block_m,), num_slots, dtype=torch.int64, device=device)
    slot_ids.scatter_(0, destination, sorted_slots.slots)

    num_blocks = block_ends[-1:].clone() if num_experts else torch.zeros(1, dtype=torch.int64, device=device)
    blocks = torch.arange(max_blocks, device=device)
    block_expert = torch.searchsorted(block_ends, blocks, right=True)
    block_expert = torch.where(blocks < num_blocks, block_expert, torch.full_like(block_expert, -1))
    return AlignedSlots(slot_ids, block_expert, num_blocks, block_ends, num_slots, block_m)
