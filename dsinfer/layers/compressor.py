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
import torch.nn.functional as F
from torch import nn

from dsinfer.kv.batch import DeviceSpans, PackedBatch, SequenceSpan
from dsinfer.kv.block_table import block_table_tensor
from dsinfer.kv.cache_v4 import CompressorCache
from dsinfer.layers.joined_linear import join_linears, joined_views
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.op_binding import reference_ops
from dsinfer.layers.rotary import apply_rope, rope_angles, step_rope_angles
from dsinfer.ops.compressor import (
    CompressorDecodeInputs,
    CompressorStoreInputs,
)
from dsinfer.ops.compressor import decode_entry_location as entry_location_on_device
from dsinfer.ops.registry import OpTable


def join_pending(
    pending_values: torch.Tensor,
    pending_gates: torch.Tensor,
    slot: int,
    start: int,
    ratio: int,
    values: torch.Tensor,
    gates: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One sequence's complete windows [c, ratio, width] of values and gates, and the position the first begins.

    The new tokens' projections (the sequence's tokens from ``start`` on) join the slot's unfinished window;
    what is left unfinished after them goes back to the slot. Both variants' compressors keep their pending
    window this way; only the window's width and dtype differ.
    """
    pending = start % ratio
    values = torch.cat([pending_values[slot, :pending], values.to(pending_values.dtype)])
    gates = torch.cat([pending_gates[slot, :pending], gates.to(pending_gates.dtype)])
    used = values.shape[0] // ratio * ratio
    leftover = values.shape[0] - used
    pending_values[slot, :leftover] = values[used:]
    pending_gates[slot, :leftover] = gates[used:]
    width = values.shape[-1]
    return values[:used].view(-1, ratio, width), gates[:used].view(-1, ratio, width), start - pending


def kept_entries(first_entry: int, reuse_below: int, ratio: int) -> slice:
    """The new entries (numbered from ``first_entry``) a prefix-cache hit does not hold already, as a slice.

    Entries of windows ending at or before ``reuse_below`` are stored: a host-known slice (a boolean mask would
    make the device report how many entries survive).
    """
    return slice(max(0, reuse_below // ratio - first_entry), None)


class Compressor(nn.Module):
    """Pools every ``ratio`` tokens into one entry: ``wkv`` values under a per-channel softmax of ``wgate`` gates.

    V4's compressors add a learned per-slot bias ``ape`` to the gates and (CSA) overlap their windows; V4.1's
    KV sources have neither, pool in fp32, and at ratio 1 have no gate at all (each token is its own entry).
    """

    def __init__(
        self,
        hidden_size: int,
        dim: int,
        ratio: int,
        overlap: bool,
        norm_eps: float,
        *,
        slot_bias: bool = True,
        pool_in_fp32: bool = False,
    ) -> None:
        super().__init__()
        self.dim, self.ratio, self.overlap, self.pool_in_fp32 = dim, ratio, overlap, pool_in_fp32
        width = 2 * dim if overlap else dim
        self.wkv = nn.Linear(hidden_size, width, bias=False)
        self.wgate = nn.Linear(hidden_size, width, bias=False) if ratio > 1 or slot_bias else None
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32)) if slot_bias else None
        self.norm = RMSNorm(dim, norm_eps)
        self.ops: OpTable = reference_ops()  # the model binds its table when it is built
        self.joined_projection: torch.Tensor | None = None  # inference: wkv and wgate stacked (join_projections)
        self._joined_fp32: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (stack, its version, fp32 copy)

    def join_projections(self) -> None:
        """Decode projects values and gates in one GEMM (inference; see ``join_linears``). Nothing to do when they
        are joined already (V4's attention stacks them with its other projections of the same input). Pooling in
        fp32, the stack's fp32 copy is made here too (with the weights, before a cache takes the free memory)."""
        if self.wgate is not None and not joined_views(self.joined_projection, self.wkv, self.wgate):
            self.joined_projection = join_linears(self.wkv, self.wgate)
        if self.pool_in_fp32 and self.joined_projection is not None:
            self._joined_in_fp32()

    def _joined_in_fp32(self) -> torch.Tensor:
        """``joined_projection`` in float32 (the fp32 pooling's GEMM): converted once, and again only when the stack
        changed (another stack, or its weights updated in place: its version counter moved), not every step.
        A stack made under inference mode counts no versions: it is converted at every call."""
        joined = self.joined_projection
        if joined.dtype == torch.float32 or joined.is_inference():
            return joined.float()
        kept = self._joined_fp32
        if kept is None or kept[0] is not joined or kept[1] != joined._version:
            kept = self._joined_fp32 = (joined, joined._version, joined.float())
        return kept[2]

    @property
    def joins_with_input(self) -> bool:
        """Whether values and gates may come from a caller's GEMM over a stack of the input's projections
        (``projected``): model-dtype projections (not pooled in fp32) with a gate."""
        return self.wgate is not None and not self.pool_in_fp32

    def project(
        self, x: torch.Tensor, positions: torch.Tensor, projected: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's value and gate [n, width] (fp32 when the variant pools in fp32).

        ``projected``: ``x`` through ``joined_projection`` (values then gates) already, from the caller's GEMM."""
        if projected is not None:
            values, gates = projected.split(self.wkv.out_features, dim=-1)
            if self.ape is not None:
                gates = gates + self.ape[positions % self.ratio].to(values.dtype)
            return values, gates
        if self.pool_in_fp32:
            return F.linear(x.float(), self.wkv.weight.float()), F.linear(x.float(), self.wgate.weight.float())
        values = self.wkv(x)
        gates = self.wgate(x)
        if self.ape is not None:
            gates = gates + self.ape[positions % self.ratio].to(values.dtype)
        return values, gates

    def latents(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        span: SequenceSpan,
        cache,
        projected: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE entries [c, dim] of the windows one sequence's new tokens complete, and their entry ids [c].

        ``cache`` holds the slot's unfinished window (``pending_values`` / ``pending_gates``) and, overlapping,
        the last complete window (``previous_values`` / ``previous_gates``). ``projected``: see :meth:`project`.
        """
        if self.wgate is None:  # ratio 1: every token is its own entry, no pooling state
            return self.norm(self.wkv(x)), positions
        ratio, slot = self.ratio, span.slot
        values, gates = self.project(x, positions, projected)
        if span.journal is not None:  # speculative decoding rolls the unfinished window back from this record
            pending = span.start % ratio
            joined_values = torch.cat([cache.pending_values[slot, :pending], values.to(cache.pending_values.dtype)])
            joined_gates = torch.cat([cache.pending_gates[slot, :pending], gates.to(cache.pending_gates.dtype)])
            span.journal.append((cache, span.start - pending, joined_values, joined_gates))
        window_values, window_gates, first = join_pending(
            cache.pending_values, cache.pending_gates, slot, span.start, ratio, values, gates
        )
        complete = window_values.shape[0]
        entry_ids = torch.arange(complete, device=x.device) + first // ratio
        if not complete:
            return window_values.new_zeros(0, self.dim).to(x.dtype), entry_ids
        if self.overlap:
            previous = None
            if first >= ratio and first - ratio >= span.window_from:
                previous = (cache.previous_values[slot], cache.previous_gates[slot])
            pool_values, pool_gates = self._overlapping_slots(window_values, window_gates, previous)
            cache.previous_values[slot] = window_values[-1]
            cache.previous_gates[slot] = window_gates[-1]
        else:
            pool_values, pool_gates = window_values, window_gates
        return self._pool(pool_values, pool_gates, x.dtype), entry_ids

    def update(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        span: SequenceSpan,
        cache: CompressorCache,
        inv_freq: torch.Tensor,
        block_table: torch.Tensor | None = None,
        projected: torch.Tensor | None = None,
    ) -> None:
        """Add one sequence's new tokens [n, hidden]; write every entry whose window they complete (V4's cache).

        ``projected``: the tokens' values and gates from the caller's GEMM (see :meth:`project`)."""
        latents, entry_ids = self.latents(x, positions, span, cache, projected)
        if entry_ids.numel():
            cos, sin = rope_angles(entry_ids * self.ratio, inv_freq)
            keep = kept_entries(span.start // self.ratio, span.reuse_below, self.ratio)
            table = span.block_table if block_table is None else block_table
            entries = apply_rope(latents, cos, sin, ops=self.ops)[keep]
            write_entries(cache, table, entry_ids[keep], entries, self.ops)

    def decode_latents(
        self, x: torch.Tensor, positions: torch.Tensor, spans: DeviceSpans, cache, projected: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One new token per sequence (``x`` [B, hidden]), all at once and with no host reads.

        Every token joins its slot's unfinished window: the pre-RoPE entries [B, dim], their entry ids [B], and
        which tokens completed their window [B] (only those entries are real; the others are unspecified; None at
        ratio 1, where every token completes its own). The same math as :meth:`latents` on a span of one token
        (the ``compressor_decode`` op).

        ``projected``: ``x`` through the projections already (``wkv``, then ``wgate`` when there is one: see
        :meth:`_decode_inputs`), from the caller's GEMM (V4.1's attention stacks a ratio-1 source's ``wkv`` with
        its other projections of the input).
        """
        if self.wgate is None:  # ratio 1: the token is its entry
            values = self.wkv(x) if projected is None else projected
            return self.norm(values), positions, None
        decode = self.ops.compressor_decode
        return decode(CompressorDecodeInputs(*self._decode_inputs(x, positions, spans, cache, projected), x.dtype))

    def update_decode(
        self,
        x: torch.Tensor,
        batch: PackedBatch,
        cache: CompressorCache,
        inv_freq: torch.Tensor,
        projected: torch.Tensor | None = None,
    ) -> None:
        """:meth:`decode_latents`, RoPE'd and written to V4's cache block of each token that completed its window
        (the ``compressor_decode_store`` op; a backend may send the others to the trash block or nowhere).

        ``projected``: ``x`` through ``joined_projection`` already [B, 2 * width], from the caller's GEMM (a view
        of its columns: the op reads the row stride)."""
        positions, spans = batch.positions, batch.device_spans
        cos, sin = step_rope_angles(batch, inv_freq, self.ratio, self.ops)
        decode_inputs = self._decode_inputs(x, positions, spans, cache, projected)
        if cache.entry_format is not None:
            self._store_coded_decode(CompressorDecodeInputs(*decode_inputs, x.dtype), cos, sin, batch, cache)
            return
        store = self.ops.compressor_decode_store
        store(CompressorStoreInputs(
            *decode_inputs, x.dtype, cos, sin, cache.entries, spans.block_tables, batch.cache.trash_block,
        ))  # fmt: skip

    def _store_coded_decode(
        self,
        inputs: CompressorDecodeInputs,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: PackedBatch,
        cache: CompressorCache,
    ) -> None:
        """:meth:`update_decode` into coded entries: the step's entries pooled (``compressor_decode``), RoPE'd, then
        encoded and written to their blocks, the rows of tokens that completed nothing to the trash block; the
        destination is chosen on the device, so a CUDA graph replays it."""
        latents, entry, complete = self.ops.compressor_decode(inputs)
        entries = apply_rope(latents, cos, sin, ops=self.ops)
        per_block, trash = cache.entries.shape[1], batch.cache.trash_block
        blocks, rows = decode_entry_location(batch.device_spans, entry, complete, per_block, trash, self.ops)
        cache.store_rows(blocks, rows, entries, self.ops)

    def _decode_inputs(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        spans: DeviceSpans,
        cache,
        projected: torch.Tensor | None = None,
    ) -> tuple:
        """The decode ops' arguments up to the norm's: projections (the slot bias left to the op), state tensors."""
        if projected is None and self.joined_projection is not None:
            joined = self.joined_projection
            projected = F.linear(x.float(), self._joined_in_fp32()) if self.pool_in_fp32 else F.linear(x, joined)
        if projected is not None:
            values, gates = projected.split(self.wkv.out_features, dim=1)  # views: the op reads their row stride
        elif self.pool_in_fp32:
            values, gates = self.project(x, positions)
        else:
            values, gates = self.wkv(x), self.wgate(x)
        previous = (cache.previous_values, cache.previous_gates) if self.overlap else (None, None)
        return (
            values, gates, self.ape if not self.pool_in_fp32 else None, positions, spans.slots, spans.window_from,
            cache.pending_values, cache.pending_gates, *previous, self.norm.weight, self.norm.eps,
        )  # fmt: skip

    def _pool(self, values: torch.Tensor, gates: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Softmax(gate)-weighted sum over each window's slots [n, slots, dim], then RMSNorm (pre-RoPE entries)."""
        pool = self.ops.compressor_pool
        return pool(values, gates, self.norm.weight, self.norm.eps, dtype)

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


def decode_entry_location(
    spans: DeviceSpans,
    entry: torch.Tensor,
    complete: torch.Tensor | None,
    per_block: int,
    trash: int,
    ops: OpTable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, row) of each sequence's decode entry [B]: its block-table block if ``complete`` (None: all are),
    else the trash (the ``decode_entry_location`` op of ``ops``; None: the reference)."""
    locate = ops.decode_entry_location if ops is not None else entry_location_on_device
    return locate(spans.block_tables, entry, complete, per_block, trash)


def _entry_location(cache: CompressorCache, block_table: list[int] | torch.Tensor, entry_ids: torch.Tensor):
    per_block = cache.entries.shape[1]
    table = block_table_tensor(block_table, entry_ids.device)
    return table[entry_ids // per_block], entry_ids % per_block


def write_entries(
    cache: CompressorCache,
    block_table: list[int] | torch.Tensor,
    entry_ids: torch.Tensor,
    entries: torch.Tensor,
    ops: OpTable | None = None,
):
    """Store entries (by their index in the sequence) into the sequence's blocks, encoded when the cache codes them
    (``ops``: the table to encode with; None: the one for the entries' device and dtype)."""
    if entry_ids.numel():
        blocks, offsets = _entry_location(cache, block_table, entry_ids)
        cache.store_rows(blocks, offsets, entries, ops)


def read_entries(
    cache: CompressorCache,
    block_table: list[int] | torch.Tensor,
    count: int,
    ops: OpTable | None = None,
    decoded: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The first ``count`` entries of a sequence, [count, dim] (coded entries decoded to ``decoded``: float32 or
    bfloat16, :meth:`CompressorCache.load_rows`)."""
    entry_ids = torch.arange(count, device=cache.entries.device)
    blocks, offsets = _entry_location(cache, block_table, entry_ids)
    return cache.load_rows(blocks, offsets, ops, decoded)


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """How many compressed entries each query position may see: entry w needs all of its window."""
    if ratio == 1:  # every position is its own entry (no division kernel)
        return positions + 1
    return torch.div(positions + 1, ratio, rounding_mode="floor")
