"""Undo the cache writes a verify forward made for rejected drafts, in V4's and V4.1's caches alike.

The verify forward runs a sequence's last token and its drafts as one span and writes every cache kind for all
of them. Once the drafts are judged, :meth:`CacheRollback.rollback` makes the slot and blocks look exactly as if
only the accepted positions had run:

* **window ring** (V4.1 with quantized storage: its FP8 codes and scales): rows of rejected positions overwrote
  the rows of positions one window earlier, which later queries still see; they are put back from the snapshot
  taken before the forward.
* **compressor state** (V4's main and indexer compressors, V4.1's KV sources): the unfinished window and, for
  overlapping (V4 CSA) compressors, the last complete window are rebuilt from the projected values and gates
  the forward recorded in the span's journal (:meth:`~dsinfer.layers.compressor.Compressor.latents`), cut at
  the accepted length. V4.1's ratio-1 sources keep no such state.
* **compressed entries** (V4.1: also the index keys, and their scales when quantized) of windows that only
  rejected positions completed are put back from the snapshot (they are never visible before their window
  completes, but a rolled-back cache equals one that never drafted).
* **Engram history** (V4.1): the slot's n-gram look-back moved past every span token; it is recomputed from the
  context before the span and the accepted tokens.

V4.1's DSpark rings need nothing here: the drafter writes them only after judging, from the kept positions
(:mod:`dsinfer.spec.dspark`). Blocks past the accepted tokens go back to the pool on the engine side
(``BlockManager.trim``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from dsinfer.engram.hashing import ENGRAM_DEAD, EngramHasher
from dsinfer.kv.batch import SequenceSpan
from dsinfer.kv.cache_v4 import KVCache
from dsinfer.kv.cache_v41 import KVCacheV41


@dataclass
class CompressorTensors:
    """One compressor's state, whichever cache holds it."""

    journal_key: object  # the state object the compressor names in the span's journal
    ratio: int
    pending: tuple[torch.Tensor, torch.Tensor] | None  # unfinished window [slots, ratio, width]; None: ratio 1
    previous: tuple[torch.Tensor, torch.Tensor] | None  # overlapping only: the last complete window
    entries: list[torch.Tensor]  # [blocks, block_tokens // ratio, ...]: entries, index keys, their scales


@dataclass
class CompressorSnapshot:
    previous: tuple[torch.Tensor, torch.Tensor] | None  # the slot's last complete window before the forward
    first_entry: int  # entries first_entry .. (span end) // ratio - 1 are those the forward may write
    entries: list[torch.Tensor]  # their values before the forward, one per entry tensor


@dataclass
class SpanSnapshot:
    """What a verify span may overwrite, saved before its forward."""

    span: SequenceSpan
    ring_rows: list[torch.Tensor]  # per ring tensor: rows of the span's positions [length, ...]
    compressors: list[CompressorSnapshot] = field(default_factory=list)  # in the order of the cache's compressors
    engram_context: torch.Tensor | None = None  # V4.1: the slot's Engram look-back before the span [w]
    token_ids: torch.Tensor | None = None  # V4.1: the span's tokens (the accepted ones rebuild the look-back)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """One-byte tensors (FP8 codes, scales) through a uint8 view: advanced indexing of float8 is missing on
    some devices and torch versions."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


def _ring_tensors(cache: KVCache | KVCacheV41, num_layers: int) -> list[torch.Tensor]:
    """Every per-slot ring [slots, window, ...] of the target layers (V4.1 quantized: codes and scales)."""
    rings = []
    for layer in cache.layers[:num_layers]:
        rings.append(layer.window)
        scales = getattr(layer, "window_scales", None)
        if scales is not None:
            rings.append(scales)
    return rings


def _compressor_tensors(cache: KVCache | KVCacheV41, num_layers: int) -> Iterator[CompressorTensors]:
    if isinstance(cache, KVCacheV41):
        for layer in cache.layers[:num_layers]:
            source = layer.source
            if source is None:
                continue
            pending = None if source.pending_values is None else (source.pending_values, source.pending_gates)
            stored = (source.entries, source.index_keys, source.entry_scales, source.index_key_scales)
            yield CompressorTensors(source, source.ratio, pending, None, [t for t in stored if t is not None])
        return
    for layer in cache.layers[:num_layers]:
        for compressor in (layer.compressor, layer.indexer):
            if compressor is not None:
                previous = (compressor.previous_values, compressor.previous_gates) if compressor.overlap else None
                pending = (compressor.pending_values, compressor.pending_gates)
                yield CompressorTensors(compressor, compressor.ratio, pending, previous, [compressor.entries])


def _entry_location(entries: torch.Tensor, table: list[int], first: int, stop: int):
    """(blocks, offsets) of a sequence's entries ``first .. stop - 1``, built on the host (no device read)."""
    per_block = entries.shape[1]
    device = entries.device
    blocks = torch.tensor([table[e // per_block] for e in range(first, stop)], dtype=torch.long, device=device)
    offsets = torch.tensor([e % per_block for e in range(first, stop)], dtype=torch.long, device=device)
    return blocks, offsets


class CacheRollback:
    """Snapshots verify spans before their forward and rolls them back to their accepted length after it.

    ``num_layers``: the target's layers (V4's cache also holds the MTP layers' rings, which the drafter keeps
    itself); ``engram_hasher``: V4.1's, when the model has Engram layers (their look-back is rolled back too).
    """

    def __init__(self, cache: KVCache | KVCacheV41, num_layers: int, engram_hasher: EngramHasher | None = None):
        self.cache, self.num_layers = cache, num_layers
        self.rings = _ring_tensors(cache, num_layers)
        self.compressors = list(_compressor_tensors(cache, num_layers))
        history = getattr(cache, "engram_history", None)
        self.engram_history = history if engram_hasher is not None and history is not None else None
        self.engram_hasher = engram_hasher

    def snapshot(self, span: SequenceSpan, token_ids: torch.Tensor | None = None) -> SpanSnapshot:
        """Save what a forward over ``span`` (its tokens ``token_ids`` [length]) can overwrite."""
        device = self.rings[0].device
        positions = torch.arange(span.start, span.start + span.length, device=device)
        rows = [_bytes(ring)[span.slot, positions % ring.shape[1]].clone() for ring in self.rings]
        snapshot = SpanSnapshot(span, rows)
        end = span.start + span.length
        for compressor in self.compressors:
            first, stop = span.start // compressor.ratio, end // compressor.ratio
            blocks, offsets = _entry_location(compressor.entries[0], span.block_table, first, stop)
            previous = None
            if compressor.previous is not None:
                previous = tuple(t[span.slot].clone() for t in compressor.previous)
            saved = [_bytes(t)[blocks, offsets].clone() for t in compressor.entries]
            snapshot.compressors.append(CompressorSnapshot(previous, first, saved))
        if self.engram_history is not None:
            if token_ids is None:
                raise ValueError("a V4.1 span snapshot needs the span's token ids (the Engram look-back)")
            history = self.engram_history[span.slot].clone()
            snapshot.engram_context = history.fill_(ENGRAM_DEAD) if span.start == 0 else history
            snapshot.token_ids = token_ids
        return snapshot

    def rollback(self, snapshot: SpanSnapshot, journal: list, keep: int) -> None:
        """Make the cache hold only the first ``keep`` positions of the snapshot's span (``keep`` >= 1).

        ``journal`` is the span's record of compressor updates: ``(state, first, values, gates)``, the values and
        gates of positions ``first ..`` of the window the span started in, through the span's end.
        """
        span = snapshot.span
        if keep >= span.length:
            return
        kept_end = span.start + keep  # positions below it are accepted
        rejected = torch.arange(kept_end, span.start + span.length, device=self.rings[0].device)
        for ring, saved in zip(self.rings, snapshot.ring_rows, strict=True):
            _bytes(ring)[span.slot, rejected % ring.shape[1]] = saved[keep:]
        records = {id(record[0]): record for record in journal}
        for compressor, saved in zip(self.compressors, snapshot.compressors, strict=True):
            self._rollback_compressor(compressor, saved, records.get(id(compressor.journal_key)), span, kept_end)
        if snapshot.engram_context is not None:
            tokens, context = snapshot.token_ids[:keep], snapshot.engram_context[None]
            self.engram_history[span.slot] = self.engram_hasher.prefill_step(tokens, [keep], context)[1][0]

    @staticmethod
    def _rollback_compressor(
        compressor: CompressorTensors, saved: CompressorSnapshot, record, span: SequenceSpan, kept_end: int
    ) -> None:
        ratio = compressor.ratio
        window = kept_end // ratio  # the window the next position joins
        if compressor.pending is not None:
            _, first, values, gates = record
            pending_values, pending_gates = compressor.pending
            pending = kept_end - window * ratio
            lo = window * ratio - first
            pending_values[span.slot, :pending] = values[lo : lo + pending].to(pending_values.dtype)
            pending_gates[span.slot, :pending] = gates[lo : lo + pending].to(pending_gates.dtype)
            if compressor.previous is not None:
                previous_values, previous_gates = compressor.previous
                if lo >= ratio:  # the last complete window ended inside the accepted part of the span
                    previous_values[span.slot] = values[lo - ratio : lo].to(previous_values.dtype)
                    previous_gates[span.slot] = gates[lo - ratio : lo].to(previous_gates.dtype)
                else:
                    previous_values[span.slot] = saved.previous[0]
                    previous_gates[span.slot] = saved.previous[1]
        stop = saved.first_entry + saved.entries[0].shape[0]
        undo_from = max(window, saved.first_entry)  # windows only rejected positions completed
        if undo_from < stop:
            blocks, offsets = _entry_location(compressor.entries[0], span.block_table, undo_from, stop)
            for tensor, values in zip(compressor.entries, saved.entries, strict=True):
                _bytes(tensor)[blocks, offsets] = values[undo_from - saved.first_entry :]
