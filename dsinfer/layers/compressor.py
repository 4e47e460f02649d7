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

from dsinfer.kv.batch import DeviceSpans, SequenceSpan
from dsinfer.kv.block_table import block_table_tensor
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
        block_table: torch.Tensor | None = None,
    ) -> None:
        """Add one sequence's new tokens [n, hidden]; write every entry whose window they complete."""
        ratio, slot = self.ratio, span.slot
        values = self.wkv(x)
        gates = self.wgate(x) + self.ape[positions % ratio].to(values.dtype)
        pending = span.start % ratio
        first = span.start - pending  # position where the unfinished window began
        values = torch.cat([cache.pending_values[slot, :pending], values])
        gates = torch.cat([cache.pending_gates[slot, :pending], gates])
        if span.journal is not None:
            span.journal.append((cache, first, values, gates))
        complete = values.shape[0] // ratio
        if complete:
            window_values = values[: complete * ratio].view(complete, ratio, -1)
            window_gates = gates[: complete * ratio].view(complete, ratio, -1)
            previous = None
            if self.overlap and first >= ratio and first - ratio >= span.window_from:
                previous = (cache.previous_values[slot], cache.previous_gates[slot])
            entry_ids = torch.arange(complete, device=x.device) + first // ratio
            pooled = self._pool(window_values, window_gates, previous, entry_ids * ratio, inv_freq)
            # Prefix-cache hits already hold the entries of windows ending at or before reuse_below: a host-known
            # slice (a boolean mask would make the device report how many entries survive).
            keep = slice(max(0, span.reuse_below // ratio - first // ratio), None)
            table = span.block_table if block_table is None else block_table
            write_entries(cache, table, entry_ids[keep], pooled[keep])
            if self.overlap:
                cache.previous_values[slot] = window_values[-1]
                cache.previous_gates[slot] = window_gates[-1]
        leftover = values.shape[0] - complete * ratio
        cache.pending_values[slot, :leftover] = values[complete * ratio :]
        cache.pending_gates[slot, :leftover] = gates[complete * ratio :]

    def update_decode(
        self, x: torch.Tensor, positions: torch.Tensor, spans: DeviceSpans, cache: CompressorCache, inv_freq, trash: int
    ) -> None:
        """One new token per sequence (``x`` [B, hidden]), all sequences at once, with no host reads.

        Every token joins its slot's unfinished window; every window is pooled, and the entry goes to the
        sequence's block when the token completed its window, to the trash block otherwise. The same math as
        :meth:`update` on a span of one token.
        """
        ratio, slots = self.ratio, spans.slots
        values = self.wkv(x)
        offset = positions % ratio
        gates = self.wgate(x) + self.ape[offset].to(values.dtype)
        cache.pending_values[slots, offset] = values.to(cache.pending_values.dtype)
        cache.pending_gates[slots, offset] = gates.to(cache.pending_gates.dtype)
        window_values, window_gates = cache.pending_values[slots], cache.pending_gates[slots]  # [B, ratio, width]
        first = positions - offset
        complete = offset == ratio - 1
        if self.overlap:
            has_previous = (first >= ratio) & (first - ratio >= spans.window_from)
            previous_gates = cache.previous_gates[slots][..., : self.dim]
            previous_gates = previous_gates.masked_fill(~has_previous[:, None, None], float("-inf"))
            previous_values = cache.previous_values[slots][..., : self.dim] * has_previous[:, None, None]
            pool_values = torch.cat([previous_values, window_values[..., self.dim :]], dim=1)
            pool_gates = torch.cat([previous_gates, window_gates[..., self.dim :]], dim=1)
        else:
            pool_values, pool_gates = window_values, window_gates
        pooled = self._pool_slots(pool_values, pool_gates, first, inv_freq)
        entry = first // ratio
        per_block = cache.entries.shape[1]
        column = (entry // per_block).clamp(max=spans.max_blocks - 1)
        block = spans.block_tables.gather(1, column[:, None]).squeeze(1)
        block = torch.where(complete, block, torch.full_like(block, trash))
        cache.entries[block, entry % per_block] = pooled.to(cache.entries.dtype)
        if self.overlap:
            keep = complete[:, None, None]
            cache.previous_values[slots] = torch.where(keep, window_values, cache.previous_values[slots])
            cache.previous_gates[slots] = torch.where(keep, window_gates, cache.previous_gates[slots])

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
        return self._pool_slots(values, gates, positions, inv_freq)

    def _pool_slots(
        self, values: torch.Tensor, gates: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> torch.Tensor:
        """Softmax(gate)-weighted sum over each window's slots [n, slots, dim], RMSNorm, RoPE at ``positions``."""
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


def _entry_location(cache: CompressorCache, block_table: list[int] | torch.Tensor, entry_ids: torch.Tensor):
    per_block = cache.entries.shape[1]
    table = block_table_tensor(block_table, entry_ids.device)
    return table[entry_ids // per_block], entry_ids % per_block


def write_entries(
    cache: CompressorCache, block_table: list[int] | torch.Tensor, entry_ids: torch.Tensor, entries: torch.Tensor
):
    """Store entries (by their index in the sequence) into the sequence's blocks."""
    if entry_ids.numel():
        blocks, offsets = _entry_location(cache, block_table, entry_ids)
        cache.entries[blocks, offsets] = entries.to(cache.entries.dtype)


def read_entries(cache: CompressorCache, block_table: list[int] | torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` entries of a sequence, [count, dim]."""
    entry_ids = torch.arange(count, device=cache.entries.device)
    blocks, offsets = _entry_location(cache, block_table, entry_ids)
    return cache.entries[blocks, offsets]


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """How many compressed entries each query position may see: entry w needs all of its window."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")


def gather_entries(cache: CompressorCache, spans: DeviceSpans) -> torch.Tensor:
    """Every entry slot of every sequence's block table, [B, max_blocks * per_block, dim] (callers mask)."""
    blocks = cache.entries[spans.block_tables]  # [B, max_blocks, per_block, dim]
    return blocks.flatten(1, 2)
