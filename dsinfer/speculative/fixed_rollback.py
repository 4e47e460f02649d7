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

import torch

from dsinfer.engram.hashing import ENGRAM_DEAD
from dsinfer.kv.fixed_width import FixedWidthBatch
from dsinfer.ops.registry import resolve
from dsinfer.ops.step_plan import EntryIndex, PendingPlan
from dsinfer.speculative.rollback import CacheRollback, _bytes


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


class FixedWidthRollback:
    """Snapshot [B, ...] tensors before a fixed-width verify forward and roll rejected positions back after it."""

    def __init__(self, rollback: CacheRollback) -> None:
        # Every layer's ring rows through its cache's stacks: one gather and one scatter a stack, not one a layer.
        self.ring_stacks = rollback.cache.ring_stacks(rollback.num_layers)
        self.layers, num_slots, self.window = self.ring_stacks[0].shape[:3]  # shared by the stacks of one cache
        self.rows_per_layer = num_slots * self.window
        self.compressors = rollback.compressors
        self.engram_history, self.engram_hasher = rollback.engram_history, rollback.engram_hasher
        self.ops = resolve(rollback.device, torch.float32)  # the plans' ops read and write only integers

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

        ring_index = self._ring_rows(batch, None)
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
        ring_index = self._ring_rows(batch, kept)  # rejected positions to their slot, kept ones to the spare slot
        for stack in self.ring_stacks:
            _stack_as_rows(stack)[ring_index] = _bytes(saved.pop()).reshape(ring_index.shape[0], *stack.shape[3:])
        kept_end, cut, entry_indexes, plans = batch.starts + kept, kept < batch.width, {}, {}
        for compressor in self.compressors:
            previous = None
            if compressor.previous is not None:
                previous = (saved.pop(), saved.pop())
            if compressor.pending is not None:
                if compressor.ratio not in plans:
                    plans[compressor.ratio] = self.ops.step_pending_plan(
                        batch.starts, batch.slots, kept_end, cut, batch.spare_slot, compressor.ratio, batch.width
                    )
                values, gates = records[id(compressor.journal_key)]
                self._rollback_pending(compressor, (values, gates), previous, plans[compressor.ratio])
            index = self._shared_entry_index(batch, compressor, entry_indexes, kept_end)
            for entries in compressor.entries:  # entries only rejected positions completed, the rest to the trash
                _bytes(entries)[index.undo_blocks, index.offsets] = saved.pop()
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
        hasher = self.engram_hasher
        self.ops.step_engram_lookback(self.engram_history, context, batch.input_ids, hasher.compressed_vocabulary,
                                      hasher.image_token_id, kept, cut, batch.slots)  # fmt: skip

    # ---- indexes -------------------------------------------------------------------------------------
    def _ring_rows(self, batch: FixedWidthBatch, kept: torch.Tensor | None) -> torch.Tensor:
        """The flat row [B * layers * width] of every position of the step in every layer of the ring stacks
        (:func:`_stack_as_rows`), sequence after sequence, each in its sequence's slot; with ``kept`` [B], the kept
        positions' in the spare slot."""
        return self.ops.step_ring_rows(batch.positions, batch.slots, kept, batch.spare_slot, self.window, self.layers,
                                       self.rows_per_layer)  # fmt: skip

    def _shared_entry_index(self, batch: FixedWidthBatch, compressor, built: dict, kept_end=None) -> EntryIndex:
        """The entries each sequence's positions may complete (at most ``(ratio - 1 + width) // ratio``; with
        ``kept_end``, a rollback's undo blocks too), built once for the compressors of one ratio and block layout
        (``built``: by key)."""
        per_block = compressor.entries[0].shape[1]
        key = (compressor.ratio, per_block)
        if key not in built:
            built[key] = self.ops.step_entry_index(batch.starts, batch.block_tables, batch.width, compressor.ratio,
                                                   per_block, batch.cache.trash_block, kept_end)  # fmt: skip
        return built[key]
