"""Undo the cache writes a verify forward made for rejected drafts (V4's :class:`~dsinfer.kv.cache_v4.KVCache`).

The verify forward runs a sequence's last token and its drafts as one span and writes every cache kind for all
of them. Once the drafts are judged, :func:`rollback_span` makes the slot and blocks look exactly as if only
the accepted positions had run:

* **window ring**: rows of rejected positions overwrote the rows of positions one window earlier, which later
  queries still see; they are put back from the snapshot taken before the forward.
* **compressor state** (main and indexer): the unfinished window and, for overlapping (CSA) compressors, the
  last complete window are rebuilt from the projected values and gates the forward recorded in the span's
  journal (:meth:`~dsinfer.layers.compressor.Compressor.update`), cut at the accepted length.
* **compressed entries and indexer keys** of windows that only rejected positions completed are put back from
  the snapshot (they are never visible before their window completes, but a rolled-back cache equals one
  that never drafted).

Blocks past the accepted tokens go back to the pool on the engine side (``BlockManager.trim``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsinfer.kv.batch import SequenceSpan
from dsinfer.kv.cache_v4 import CompressorCache, KVCache


@dataclass
class CompressorSnapshot:
    previous: tuple[torch.Tensor, torch.Tensor] | None  # the slot's last complete window before the forward
    first_entry: int  # entries first_entry .. (span end) // ratio - 1 are those the forward may write
    entries: torch.Tensor  # their values before the forward


@dataclass
class SpanSnapshot:
    """What a verify span may overwrite, saved before its forward."""

    span: SequenceSpan
    ring_rows: list[torch.Tensor]  # per target layer: ring rows of the span's positions [length, head_dim]
    compressors: dict[int, CompressorSnapshot] = field(default_factory=dict)  # by id() of the CompressorCache


def _entry_location(cache: CompressorCache, table: list[int], first: int, stop: int):
    """(blocks, offsets) of a sequence's entries ``first .. stop - 1``, built on the host (no device read)."""
    per_block = cache.entries.shape[1]
    device = cache.entries.device
    blocks = torch.tensor([table[e // per_block] for e in range(first, stop)], dtype=torch.long, device=device)
    offsets = torch.tensor([e % per_block for e in range(first, stop)], dtype=torch.long, device=device)
    return blocks, offsets


def _compressor_caches(cache: KVCache, num_layers: int):
    for layer in cache.layers[:num_layers]:
        for compressor in (layer.compressor, layer.indexer):
            if compressor is not None:
                yield compressor


def snapshot_span(cache: KVCache, span: SequenceSpan, num_layers: int) -> SpanSnapshot:
    """Save what a forward over ``span`` can overwrite in the first ``num_layers`` (target) layers."""
    device = cache.layers[0].window.device
    positions = torch.arange(span.start, span.start + span.length, device=device)
    rows = [layer.window[span.slot, positions % layer.window.shape[1]].clone() for layer in cache.layers[:num_layers]]
    snapshot = SpanSnapshot(span, rows)
    end = span.start + span.length
    for compressor in _compressor_caches(cache, num_layers):
        ratio = compressor.ratio
        blocks, offsets = _entry_location(compressor, span.block_table, span.start // ratio, end // ratio)
        previous = None
        if compressor.overlap:
            previous = (compressor.previous_values[span.slot].clone(), compressor.previous_gates[span.slot].clone())
        snapshot.compressors[id(compressor)] = CompressorSnapshot(
            previous, span.start // ratio, compressor.entries[blocks, offsets].clone()
        )
    return snapshot


def rollback_span(cache: KVCache, snapshot: SpanSnapshot, journal: list, keep: int, num_layers: int) -> None:
    """Make the cache hold only the first ``keep`` positions of the snapshot's span (``keep`` >= 1).

    ``journal`` is the span's record of compressor updates: ``(CompressorCache, first, values, gates)``, the
    values and gates of positions ``first ..`` of the window the span started in, through the span's end.
    """
    span = snapshot.span
    if keep >= span.length:
        return
    kept_end = span.start + keep  # positions below it are accepted
    device = cache.layers[0].window.device
    rejected = torch.arange(kept_end, span.start + span.length, device=device)
    for layer, saved in zip(cache.layers[:num_layers], snapshot.ring_rows, strict=True):
        layer.window[span.slot, rejected % layer.window.shape[1]] = saved[keep:]
    by_cache = {id(record[0]): record for record in journal}
    for compressor in _compressor_caches(cache, num_layers):
        saved = snapshot.compressors[id(compressor)]
        _, first, values, gates = by_cache[id(compressor)]
        ratio = compressor.ratio
        window = kept_end // ratio  # the window the next position joins
        pending = kept_end - window * ratio
        lo = window * ratio - first
        compressor.pending_values[span.slot, :pending] = values[lo : lo + pending].to(compressor.pending_values.dtype)
        compressor.pending_gates[span.slot, :pending] = gates[lo : lo + pending].to(compressor.pending_gates.dtype)
        if compressor.overlap:
            if lo >= ratio:  # the last complete window ended inside the accepted part of the span
                compressor.previous_values[span.slot] = values[lo - ratio : lo].to(compressor.previous_values.dtype)
                compressor.previous_gates[span.slot] = gates[lo - ratio : lo].to(compressor.previous_gates.dtype)
            else:
                compressor.previous_values[span.slot] = saved.previous[0]
                compressor.previous_gates[span.slot] = saved.previous[1]
        stop = saved.first_entry + saved.entries.shape[0]
        undo_from = max(window, saved.first_entry)  # windows only rejected positions completed
        if undo_from < stop:
            blocks, offsets = _entry_location(compressor, span.block_table, undo_from, stop)
            compressor.entries[blocks, offsets] = saved.entries[undo_from - saved.first_entry :]
