"""Token compressors: pool every ``ratio`` tokens of a sequence into one compressed KV entry.

Each token contributes a value ``wkv(x)`` and a gate ``wgate(x) + ape[position % ratio]``; an entry is the
per-channel softmax(gate)-weighted sum of its window's values, then RMSNorm and RoPE at the window's first
position. CSA (ratio 4) windows overlap: each token projects to two halves, ``Ca`` feeding the next window
and ``Cb`` its own, so an entry pools 2 * ratio slots. HCA (ratio 128) windows do not overlap. The
lightning indexer owns a second, narrower compressor of the same kind.

Tokens arrive in pieces (prefill chunks, decode steps): the unfinished window waits in the sequence's
state slot, and finished entries go to the sequence's cache blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.kv.batch import SequenceSpan
from dsinfer.kv.cache_v4 import CompressorCache
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.rotary import apply_rope, rope_angles


class Compressor(nn.Module):
    def __init__(self, hidden_size: int, dim: int, ratio: int, overlap: bool, norm_eps: float) -> None:
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = 2 * dim if overlap else dim
        self.wkv = nn.Linear(hidden_size, width, bias=False)
        self.wgate = nn.Linear(hidden_size, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, norm_eps)

    def update(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        span: SequenceSpan,
        cache: CompressorCache,
        inv_freq: torch.Tensor,
    ) -> None:
        """Add one sequence's new tokens [n, hidden]; write every entry whose window they complete."""
        ratio, slot = self.ratio, span.slot
        values = self.wkv(x)
        gates = self.wgate(x) + self.ape[positions % ratio].to(values.dtype)
        pending = span.start % ratio
        first = span.start - pending  # position where the unfinished window began
        values = torch.cat([cache.pending_values[slot, :pending], values])
        gates = torch.cat([cache.pending_gates[slot, :pending], gates])
        complete = values.shape[0] // ratio
        if complete:
            window_values = values[: complete * ratio].view(complete, ratio, -1)
            window_gates = gates[: complete * ratio].view(complete, ratio, -1)
            previous = None
            if self.overlap and first >= ratio and first - ratio >= span.window_from:
                previous = (cache.previous_values[slot], cache.previous_gates[slot])
            entry_ids = torch.arange(complete, device=x.device) + first // ratio
            pooled = self._pool(window_values, window_gates, previous, entry_ids * ratio, inv_freq)
            keep = (entry_ids + 1) * ratio > span.reuse_below  # prefix-cache hits already hold older entries
            write_entries(cache, span.block_table, entry_ids[keep], pooled[keep])
            if self.overlap:
                cache.previous_values[slot] = window_values[-1]
                cache.previous_gates[slot] = window_gates[-1]
        leftover = values.shape[0] - complete * ratio
        cache.pending_values[slot, :leftover] = values[complete * ratio :]
        cache.pending_gates[slot, :leftover] = gates[complete * ratio :]

    def _pool(
        self,
        values: torch.Tensor,
        gates: torch.Tensor,
        previous: tuple[torch.Tensor, torch.Tensor] | None,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        """Entries [n, dim] from complete windows [n, ratio, width] (plus the window before them, if overlapping)."""
        if self.overlap:
            values, gates = self._overlapping_slots(values, gates, previous)
        weights = gates.softmax(dim=1, dtype=torch.float32).to(values.dtype)
        pooled = self.norm((values * weights).sum(dim=1))
        cos, sin = rope_angles(positions, inv_freq)
        return apply_rope(pooled, cos, sin)

    def _overlapping_slots(
        self, values: torch.Tensor, gates: torch.Tensor, previous: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Window w pools window w-1's ``Ca`` half and its own ``Cb`` half (2 * ratio slots).

        Without a predecessor (window 0) the ``Ca`` slots get zero value and -inf gate: softmax weight 0.
        """
        dim = self.dim
        previous_values = torch.zeros_like(values[..., :dim])
        previous_gates = torch.full_like(gates[..., :dim], float("-inf"))
        previous_values[1:] = values[:-1, :, :dim]
        previous_gates[1:] = gates[:-1, :, :dim]
        if previous is not None:
            previous_values[0] = previous[0][:, :dim]
            previous_gates[0] = previous[1][:, :dim]
        slots_values = torch.cat([previous_values, values[..., dim:]], dim=1)
        slots_gates = torch.cat([previous_gates, gates[..., dim:]], dim=1)
        return slots_values, slots_gates


def _entry_location(cache: CompressorCache, block_table: list[int], entry_ids: torch.Tensor):
    per_block = cache.entries.shape[1]
    table = torch.tensor(block_table, dtype=torch.long, device=entry_ids.device)
    return table[entry_ids // per_block], entry_ids % per_block


def write_entries(cache: CompressorCache, block_table: list[int], entry_ids: torch.Tensor, entries: torch.Tensor):
    """Store entries (by their index in the sequence) into the sequence's blocks."""
    if entry_ids.numel():
        blocks, offsets = _entry_location(cache, block_table, entry_ids)
        cache.entries[blocks, offsets] = entries.to(cache.entries.dtype)


def read_entries(cache: CompressorCache, block_table: list[int], count: int) -> torch.Tensor:
    """The first ``count`` entries of a sequence, [count, dim]."""
    entry_ids = torch.arange(count, device=cache.entries.device)
    blocks, offsets = _entry_location(cache, block_table, entry_ids)
    return cache.entries[blocks, offsets]


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """How many compressed entries each query position may see: entry w needs all of its window."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")
