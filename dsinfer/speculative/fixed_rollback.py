"""Snapshot and rollback of a fixed-width verify step from device tensors alone, for the step's CUDA graphs.

:class:`~dsinfer.speculative.rollback.CacheRollback` builds its gather and scatter indexes on the host from the
spans' metadata; a step replayed from a CUDA graph cannot. Here every sequence of a fixed-width batch
(:class:`~dsinfer.kv.fixed_width.FixedWidthBatch`: ``width`` = K + 1 new positions each) is snapshotted and rolled
back at full width, with the accepted counts as a device tensor: each cache tensor (every layer's rings as one
stack) is read at every position the step may write and written back at full width in one scatter, the rows of
kept positions sent where no sequence reads (ring rows to the spare slot, entries to the trash block; no shape
depends on a device value), so the snapshot, the judge and the rollback are captured with the verify forward and
its drafts, and the host reads the step's result once.

What is restored is what :class:`~dsinfer.speculative.rollback.CacheRollback` restores, the same way: window-ring
rows of rejected positions from the snapshot; each compressor's unfinished window (and, overlapping, its last
complete one) rebuilt from the fixed-width journal (:class:`~dsinfer.kv.fixed_width.PendingJournal`) cut at the
accepted length; compressed entries (index keys, scales) of windows only rejected positions completed; V4.1's
Engram look-back from the context before the span and the accepted tokens. Padding rows run in the spare slot
against the trash block, and entry addresses a row does not own are sent to the trash block too, so no write
lands on another sequence's state.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from dsinfer.engram.hashing import ENGRAM_DEAD
from dsinfer.kv.fixed_width import FixedWidthBatch
from dsinfer.speculative.rollback import CacheRollback, _bytes


@dataclass
class EntryIndex:
    """Where a fixed-width step may write the entries of one compressor ratio: ``per_row`` entries of each
    sequence from the one its first position falls in; ``owned`` marks those its positions complete."""

    entry_ids: torch.Tensor  # [B, per_row]
    blocks: torch.Tensor  # [B, per_row], the trash block where not owned
    offsets: torch.Tensor  # [B, per_row]
    owned: torch.Tensor  # [B, per_row] bool


def _rows_into(source: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Rows ``index`` [N] of ``source``'s first dimension, into ``out`` [N, ...] (contiguous) when given."""
    if out is None:
        return source[index]
    return torch.index_select(source, 0, index, out=out)


def _stack_as_rows(stack: torch.Tensor) -> torch.Tensor:
    """A ring stack [layers, slots, window, ...] as rows [layers * slots * window, ...] (one-byte tensors as
    uint8): a view, so a scatter into it writes the rings."""
    return _bytes(stack).view(-1, *stack.shape[3:])


def _flat_out(out: torch.Tensor | None) -> torch.Tensor | None:
    """A snapshot buffer [B, layers, width, ...] as the rows a gather writes (one-byte tensors as uint8)."""
    return None if out is None else _bytes(out).view(-1, *out.shape[3:])


@dataclass
class PendingPlan:
    """Where the rollback of one compressor ratio's unfinished windows reads and writes (shared by its
    compressors): record rows [B, ratio] and target slots for the unfinished window and, overlapping, for the last
    complete one; targets are the spare slot where a row stays as it is."""

    rows: torch.Tensor  # [ratio]
    pending_source: torch.Tensor  # [B, ratio] record row of each window row
    pending_targets: torch.Tensor  # [B, ratio] slot, or the spare slot
    previous_source: torch.Tensor  # [B, ratio]
    previous_targets: torch.Tensor  # [B] slot, or the spare slot
    recorded: torch.Tensor  # [B] the last complete window comes from the record (else from the snapshot)


def _pending_plan(batch: FixedWidthBatch, ratio: int, kept_end: torch.Tensor, cut: torch.Tensor) -> PendingPlan:
    """:class:`PendingPlan` of ``ratio`` for sequences that keep positions up to ``kept_end`` [B] (``cut``: fewer
    than the step's width). A record holds the positions from the first of the window the step started in."""
    slots, spare, length = batch.slots, batch.spare_slot, ratio - 1 + batch.width
    first = batch.starts - batch.starts % ratio
    window_start = kept_end - kept_end % ratio
    lo = window_start - first  # the record's row of the accepted end's window
    rows = torch.arange(ratio, device=slots.device)
    take = cut[:, None] & (rows[None, :] < (kept_end - window_start)[:, None])  # [B, ratio]
    recorded = cut & (lo >= ratio)  # the last complete window ended inside the accepted positions
    restored = cut & (lo < ratio)
    return PendingPlan(
        rows,
        (lo[:, None] + rows).clamp(max=length - 1),
        torch.where(take, slots[:, None], spare),
        (lo[:, None] - ratio + rows).clamp(min=0, max=length - 1),
        torch.where(recorded | restored, slots, spare),
        recorded,
    )


class FixedWidthRollback:
    """Snapshot [B, ...] tensors before a fixed-width verify forward and roll rejected positions back after it."""

    def __init__(self, rollback: CacheRollback) -> None:
        # Every layer's ring rows through its cache's stacks: one gather and one scatter a stack, not one a layer.
        self.ring_stacks = rollback.cache.ring_stacks(rollback.num_layers)
        layers, num_slots, self.window = self.ring_stacks[0].shape[:3]  # shared by the stacks of one cache
        self.layer_first_rows = torch.arange(layers, device=rollback.device) * (num_slots * self.window)
        self.compressors = rollback.compressors
        self.engram_history, self.engram_hasher = rollback.engram_history, rollback.engram_hasher

    # ---- snapshot ------------------------------------------------------------------------------------
    def snapshot(self, batch: FixedWidthBatch, into: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Everything the step may overwrite, each tensor's first dimension the batch's sequences: ring rows of
        every position, each overlapping compressor's last complete window, the entries each sequence may
        write, and V4.1's Engram look-back before the step (a sequence at position 0 has none). ``into`` (one
        tensor [B, ...] each, in this order, as a graph's static buffers) takes them in place."""
        entry_indexes, flat_indexes = {}, {}
        outs = itertools.repeat(None) if into is None else iter(into)

        def take(source: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
            """``source[first, second]``, in place into the next buffer when there are buffers."""
            out = next(outs)
            if out is None:
                return source[first, second]
            try:
                rows = source.view(-1, *source.shape[2:])
            except RuntimeError:  # leading dimensions that do not merge into one view: gathered, then copied
                return out.copy_(source[first, second])
            key = (id(first), id(second), source.shape[1])
            if key not in flat_indexes:  # shared by the sources of one layout
                flat_indexes[key] = (first * source.shape[1] + second).flatten()
            _rows_into(rows, flat_indexes[key], out.view(-1, *out.shape[2:]))
            return out

        ring_index = self._stack_rows(batch, batch.slots[:, None])
        saved = []
        for stack in self.ring_stacks:  # each [B, layers, width, ...]
            out = next(outs)
            rows = _rows_into(_stack_as_rows(stack), ring_index, _flat_out(out))
            saved.append(rows.view(batch.size, stack.shape[0], batch.width, *stack.shape[3:]) if out is None else out)
        for compressor in self.compressors:
            if compressor.previous is not None:
                saved += [_rows_into(part, batch.slots, next(outs)) for part in compressor.previous]
            index = self._shared_entry_index(batch, compressor, entry_indexes)
            saved += [take(_bytes(entries), index.blocks, index.offsets) for entries in compressor.entries]
        if self.engram_history is not None:
            history = _rows_into(self.engram_history, batch.slots, next(outs))
            saved.append(history.masked_fill_((batch.starts == 0)[:, None], ENGRAM_DEAD))
        return saved

    # ---- rollback ------------------------------------------------------------------------------------
    def rollback(self, batch: FixedWidthBatch, saved: list[torch.Tensor], records: dict, accepted: torch.Tensor):
        """Make each sequence's state hold only its first ``accepted + 1`` positions (``accepted`` [B] on the
        device); ``saved`` is :meth:`snapshot`'s list, ``records`` the step's journal (``id(state)`` -> padded
        values and gates [B, L, width]).

        Every saved row is written back, each in one scatter: a rejected position's to where it was, a kept one's
        to a place no sequence reads (ring rows to the spare slot, entries to the trash block), so no scatter
        needs the cache's current rows or a select between them."""
        kept = accepted + 1
        saved = list(reversed(saved))  # taken from the end, in snapshot order
        columns = torch.arange(batch.width, device=kept.device)
        rejected = columns[None, :] >= kept[:, None]  # [B, width]
        ring_index = self._stack_rows(batch, torch.where(rejected, batch.slots[:, None], batch.spare_slot))
        for stack in self.ring_stacks:
            _stack_as_rows(stack)[ring_index] = _bytes(saved.pop()).reshape(ring_index.shape[0], *stack.shape[3:])
        kept_end, cut, entry_indexes, plans, undo_blocks = batch.starts + kept, kept < batch.width, {}, {}, {}
        for compressor in self.compressors:
            previous = None
            if compressor.previous is not None:
                previous = (saved.pop(), saved.pop())
            if compressor.pending is not None:
                if compressor.ratio not in plans:
                    plans[compressor.ratio] = _pending_plan(batch, compressor.ratio, kept_end, cut)
                values, gates = records[id(compressor.journal_key)]
                self._rollback_pending(compressor, (values, gates), previous, plans[compressor.ratio])
            index = self._shared_entry_index(batch, compressor, entry_indexes)
            key = (compressor.ratio, compressor.entries[0].shape[1])
            if key not in undo_blocks:  # once for the compressors of one ratio and block layout
                undo = index.owned & cut[:, None] & (index.entry_ids >= (kept_end // compressor.ratio)[:, None])
                undo_blocks[key] = torch.where(undo, index.blocks, batch.cache.trash_block)
            for entries in compressor.entries:
                _bytes(entries)[undo_blocks[key], index.offsets] = saved.pop()
        if self.engram_history is not None:
            self._rollback_engram(batch, saved.pop(), kept, cut)

    def _rollback_pending(self, compressor, records, previous, plan: PendingPlan) -> None:
        """The unfinished window of each cut sequence (rows before its accepted end) and, overlapping, its last
        complete window, from the journal's record (positions from the first of the window the step started in)
        or, when that window completed before the step, from the snapshot. Each state takes one scatter: rows that
        stay as they are go to the spare slot, so no scatter reads the state's current rows."""
        rows = plan.rows[None, :]
        for state, record in zip(compressor.pending, records, strict=True):
            fresh = record.gather(1, plan.pending_source[..., None].expand(-1, -1, record.shape[-1]))
            state[plan.pending_targets, rows] = fresh.to(state.dtype)
        if compressor.previous is None:
            return
        recorded = plan.recorded[:, None, None]
        for state, record, before in zip(compressor.previous, records, previous, strict=True):
            fresh = record.gather(1, plan.previous_source[..., None].expand(-1, -1, record.shape[-1]))
            state[plan.previous_targets] = torch.where(recorded, fresh.to(state.dtype), before)

    def _rollback_engram(self, batch: FixedWidthBatch, context: torch.Tensor, kept, cut) -> None:
        """The look-back after the accepted tokens: the last ``w`` of the context and the kept tokens."""
        hasher, width = self.engram_hasher, context.shape[1]
        ids = batch.input_ids
        compressed = hasher.compressed_vocabulary[ids].masked_fill(~hasher.gate_mask(ids), ENGRAM_DEAD)
        joined = torch.cat([context, compressed.to(context.dtype)], dim=1)  # [B, w + width], oldest first
        columns = kept[:, None] + torch.arange(width, device=kept.device)[None, :]
        after = joined.gather(1, columns)
        slots = batch.slots
        self.engram_history[slots] = torch.where(cut[:, None], after, self.engram_history[slots])

    # ---- indexes -------------------------------------------------------------------------------------
    def _stack_rows(self, batch: FixedWidthBatch, slots: torch.Tensor) -> torch.Tensor:
        """The flat row [B * layers * width] of every position of the step in every layer of the ring stacks
        (:func:`_stack_as_rows`), sequence after sequence, each row in ``slots`` ([B, 1] or [B, width])."""
        within_layer = slots * self.window + batch.positions % self.window  # [B, width]
        return (self.layer_first_rows[None, :, None] + within_layer[:, None, :]).flatten()

    def _shared_entry_index(self, batch: FixedWidthBatch, compressor, built: dict) -> EntryIndex:
        """:meth:`_entry_index`, built once for the compressors of one ratio and block layout (``built``: by key)."""
        key = (compressor.ratio, compressor.entries[0].shape[1])
        if key not in built:
            built[key] = self._entry_index(batch, compressor)
        return built[key]

    @staticmethod
    def _entry_index(batch: FixedWidthBatch, compressor) -> EntryIndex:
        """The entries each sequence's positions may complete (at most ``(ratio - 1 + width) // ratio``)."""
        ratio, entries = compressor.ratio, compressor.entries[0]
        per_block, table_width = entries.shape[1], batch.block_tables.shape[1]
        per_row = (ratio - 1 + batch.width) // ratio
        first = batch.starts // ratio
        entry_ids = first[:, None] + torch.arange(per_row, device=first.device)[None, :]
        owned = entry_ids < ((batch.starts + batch.width) // ratio)[:, None]
        blocks = batch.block_tables.gather(1, (entry_ids // per_block).clamp(max=table_width - 1))
        blocks = torch.where(owned, blocks, batch.cache.trash_block)
        return EntryIndex(entry_ids, blocks, entry_ids % per_block, owned)
