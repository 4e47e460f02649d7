"""Undo the cache writes a verify forward made for rejected drafts, in V4's and V4.1's caches alike.

The verify forward runs a sequence's last token and its drafts as one span and writes every cache kind for all
of them. Once the drafts are judged, :meth:`CacheRollback.rollback_spans` makes every span's slot and blocks look
exactly as if only the accepted positions had run, all spans of a step at once (one gather per cache tensor
before the forward, one scatter after it, indexed by device tensors built from the host's span metadata; no
device value is read on the host):

* **window ring** (V4.1 with quantized storage: its FP8 codes and scales): rows of rejected positions overwrote
  the rows of positions one window earlier, which later queries still see; they are put back from the snapshot
  taken before the forward.
* **compressor state** (V4's main and indexer compressors, V4.1's KV sources): the unfinished window and, for
  overlapping (V4 CSA) compressors, the last complete window are rebuilt from the projected values and gates
  the forward recorded in the span's journal (:meth:`~dsinfer.layers.compressor.Compressor.latents`), cut at
  the accepted length; a fixed-width verify forward (:mod:`dsinfer.kv.fixed_width`) hands the same
  records over as one padded tensor per compressor (:class:`PaddedJournal`). V4.1's ratio-1 sources keep no
  such state.
* **compressed entries** (V4.1: also the index keys, and their scales when quantized) of windows that only
  rejected positions completed are put back from the snapshot (they are never visible before their window
  completes, but a rolled-back cache equals one that never drafted).
* **Engram history** (V4.1): the slot's n-gram look-back moved past every span token; it is recomputed from the
  context before the span and the accepted tokens.

V4.1's DSpark rings need nothing here: the drafter writes them only after judging, from the kept positions
(:mod:`dsinfer.speculative.dspark`). Blocks past the accepted tokens go back to the pool on the engine side
(``BlockManager.trim``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from dsinfer.engram.hashing import ENGRAM_DEAD, EngramHasher
from dsinfer.kv.batch import SequenceSpan, host_to_device
from dsinfer.kv.cache_v4 import KVCache
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.kv.compressor_state import CompressorTensors


@dataclass
class CompressorSnapshot:
    previous: tuple[torch.Tensor, torch.Tensor] | None  # each span's slot's last complete window [S, ratio, width]
    entries: list[torch.Tensor]  # per entry tensor: the entries the spans may write, span after span [E, ...]


@dataclass
class PaddedJournal:
    """Every span's compressor records at once: ``records[id(state)]`` is (values, gates) [S, L, width], span
    ``i``'s record in row ``i`` (positions from the first of the window the span starts in, ``L`` rows at least as
    many as the span's record; the rest is padding). What a fixed-width verify forward produces."""

    records: dict[int, tuple[torch.Tensor, torch.Tensor]]

    def first(self, count: int) -> PaddedJournal:
        """The records of the first ``count`` spans (a bucket's rows past them are padding)."""
        return PaddedJournal({key: (v[:count], g[:count]) for key, (v, g) in self.records.items()})


@dataclass
class StepSnapshot:
    """What a step's verify spans may overwrite, saved before their forward, all spans in one set of tensors."""

    spans: list[SequenceSpan]
    ring_rows: list[torch.Tensor]  # per ring tensor: rows of every span's positions, span after span [P, ...]
    compressors: list[CompressorSnapshot] = field(default_factory=list)  # in the order of the cache's compressors
    engram_context: torch.Tensor | None = None  # V4.1: each slot's Engram look-back before its span [S, w]
    token_ids: torch.Tensor | None = None  # V4.1: the spans' tokens end to end [P] (the accepted ones rebuild it)


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


def _entries_written(spans: list[SequenceSpan], ratio: int) -> list[range]:
    """Per span, the entries a forward over it may write: those of the windows it can complete."""
    return [range(span.start // ratio, (span.start + span.length) // ratio) for span in spans]


def _entry_index(entries: torch.Tensor, spans: list[SequenceSpan], ranges: list[range]):
    """(blocks, offsets) of every span's entries in ``ranges``, span after span, as device tensors built on the
    host (no device read)."""
    per_block = entries.shape[1]
    blocks = [span.block_table[e // per_block] for span, ids in zip(spans, ranges, strict=True) for e in ids]
    offsets = [e % per_block for ids in ranges for e in ids]
    return host_to_device(blocks, torch.long, entries.device), host_to_device(offsets, torch.long, entries.device)


class CacheRollback:
    """Snapshots a step's verify spans before their forward and rolls them back to their accepted lengths after it,
    every span at once: one gather or scatter per cache tensor, indexed by device tensors built on the host.

    ``num_layers``: the target's layers (V4's cache also holds the MTP layers' rings, which the drafter keeps
    itself); ``engram_hasher``: V4.1's, when the model has Engram layers (their look-back is rolled back too).
    """

    def __init__(self, cache: KVCache | KVCacheV41, num_layers: int, engram_hasher: EngramHasher | None = None):
        self.cache, self.num_layers = cache, num_layers
        self.rings = _ring_tensors(cache, num_layers)
        self.compressors = list(cache.rollback_compressors(num_layers))
        history = getattr(cache, "engram_history", None)
        self.engram_history = history if engram_hasher is not None and history is not None else None
        self.engram_hasher = engram_hasher
        self.device = self.rings[0].device

    def snapshot(self, span: SequenceSpan, token_ids: torch.Tensor | None = None) -> StepSnapshot:
        """Save what a forward over one ``span`` (its tokens ``token_ids`` [length]) can overwrite."""
        return self.snapshot_spans([span], token_ids)

    def rollback(self, snapshot: StepSnapshot, journal: list, keep: int) -> None:
        """Make the cache hold only the first ``keep`` positions of a one-span snapshot (``keep`` >= 1)."""
        self.rollback_spans(snapshot, [journal], [keep])

    def snapshot_spans(self, spans: list[SequenceSpan], token_ids: torch.Tensor | None = None) -> StepSnapshot:
        """Save what a forward over ``spans`` (their tokens end to end, ``token_ids`` [P]) can overwrite."""
        positions = [p for span in spans for p in range(span.start, span.start + span.length)]
        slots = [span.slot for span in spans for _ in range(span.length)]
        rows = self._ring_gather(slots, positions)
        snapshot = StepSnapshot(spans, [_bytes(ring)[rows[ring.shape[1]]].clone() for ring in self.rings])
        span_slots = host_to_device([span.slot for span in spans], torch.long, self.device)
        indexes = {}
        for compressor in self.compressors:
            entries = compressor.entries[0]
            key = (compressor.ratio, entries.shape[1])
            if key not in indexes:
                indexes[key] = _entry_index(entries, spans, _entries_written(spans, compressor.ratio))
            blocks, offsets = indexes[key]
            previous = None
            if compressor.previous is not None:
                previous = tuple(t[span_slots].clone() for t in compressor.previous)
            saved = [_bytes(t)[blocks, offsets].clone() for t in compressor.entries]
            snapshot.compressors.append(CompressorSnapshot(previous, saved))
        if self.engram_history is not None:
            if token_ids is None:
                raise ValueError("a V4.1 span snapshot needs the span's token ids (the Engram look-back)")
            history = self.engram_history[span_slots].clone()
            fresh = [index for index, span in enumerate(spans) if span.start == 0]
            if fresh:
                history[host_to_device(fresh, torch.long, self.device)] = ENGRAM_DEAD
            snapshot.engram_context, snapshot.token_ids = history, token_ids
        return snapshot

    def rollback_spans(self, snapshot: StepSnapshot, journals: list[list] | PaddedJournal, keeps: list[int]) -> None:
        """Make the cache hold only the first ``keeps[i]`` positions of the snapshot's span ``i`` (each >= 1).

        ``journals[i]`` is span i's record of compressor updates: ``(state, first, values, gates)``, the values
        and gates of positions ``first ..`` of the window the span started in, through the span's end; or one
        :class:`PaddedJournal` for all spans.
        """
        spans = snapshot.spans
        cut = [i for i, (span, keep) in enumerate(zip(spans, keeps, strict=True)) if keep < span.length]
        if not cut:
            return
        starts = list(itertools.accumulate((span.length for span in spans), initial=0))
        slots, positions, saved_rows = [], [], []
        for i in cut:
            span, keep = spans[i], keeps[i]
            rejected = range(span.start + keep, span.start + span.length)
            slots += [span.slot] * len(rejected)
            positions += rejected
            saved_rows += range(starts[i] + keep, starts[i] + span.length)
        rows = self._ring_gather(slots, positions)
        source = host_to_device(saved_rows, torch.long, self.device)
        for ring, saved in zip(self.rings, snapshot.ring_rows, strict=True):
            _bytes(ring)[rows[ring.shape[1]]] = saved[source]
        rolled = [spans[i] for i in cut]
        kept_ends = [spans[i].start + keeps[i] for i in cut]
        pending_plans, entry_plans = {}, {}  # index tensors shared by the compressors of one ratio
        for compressor, saved in zip(self.compressors, snapshot.compressors, strict=True):
            ratio = compressor.ratio
            if compressor.pending is not None:
                values, gates, bases = _journal_rows(journals, compressor, cut)
                if ratio not in pending_plans:
                    pending_plans[ratio] = self._pending_plan(rolled, cut, kept_ends, ratio, bases)
                self._rollback_pending(compressor, saved, values, gates, pending_plans[ratio])
            key = (ratio, compressor.entries[0].shape[1])
            if key not in entry_plans:
                entry_plans[key] = self._entry_plan(compressor.entries[0], spans, cut, kept_ends, ratio)
            if entry_plans[key] is not None:
                blocks, offsets, source = entry_plans[key]
                for tensor, values in zip(compressor.entries, saved.entries, strict=True):
                    _bytes(tensor)[blocks, offsets] = values[source]
        if snapshot.engram_context is not None:
            accepted = [starts[i] + j for i in cut for j in range(keeps[i])]
            tokens = snapshot.token_ids.index_select(0, host_to_device(accepted, torch.long, self.device))
            lengths = [keeps[i] for i in cut]
            ends = host_to_device(list(itertools.accumulate(lengths)), torch.long, self.device)
            context = snapshot.engram_context[host_to_device(cut, torch.long, self.device)]
            _, contexts = self.engram_hasher.prefill_step(tokens, lengths, context, ends)
            self.engram_history[host_to_device([span.slot for span in rolled], torch.long, self.device)] = contexts

    def _ring_gather(self, slots: list[int], positions: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """(slots, ring rows) of ``positions``, per ring width."""
        slot_index = host_to_device(slots, torch.long, self.device)
        position_index = host_to_device(positions, torch.long, self.device)
        return {width: (slot_index, position_index % width) for width in {ring.shape[1] for ring in self.rings}}

    def _entry_plan(self, entries: torch.Tensor, spans, cut, kept_ends, ratio: int):
        """(blocks, offsets, snapshot rows) of the entries to put back: those of windows only rejected positions
        completed; None when there are none."""
        ranges = _entries_written(spans, ratio)
        bases = list(itertools.accumulate((len(r) for r in ranges), initial=0))
        undo = [
            range(max(end // ratio, ranges[i].start), ranges[i].stop) for i, end in zip(cut, kept_ends, strict=True)
        ]
        if not any(undo):
            return None
        blocks, offsets = _entry_index(entries, [spans[i] for i in cut], undo)
        source = [bases[i] + e - ranges[i].start for i, ids in zip(cut, undo, strict=True) for e in ids]
        return blocks, offsets, host_to_device(source, torch.long, self.device)

    def _pending_plan(
        self, rolled: list[SequenceSpan], cut: list[int], kept_ends: list[int], ratio: int, bases: list[int]
    ) -> dict:
        """Where each rolled-back span's unfinished window (and, overlapping, last complete one) comes from: rows
        of its journal record, which starts at row ``bases[k]`` of the records' rows. A span's record holds
        positions from the start of the window it started in (``start - start % ratio``) through its end."""
        names = ("slots", "rows", "source", "recorded_slots", "recorded_source", "kept_slots", "kept_spans")
        lists: dict[str, list[int]] = {name: [] for name in names}
        for span, index, kept_end, base in zip(rolled, cut, kept_ends, bases, strict=True):
            first = span.start - span.start % ratio
            window = kept_end // ratio
            pending, lo = kept_end - window * ratio, window * ratio - first
            lists["slots"] += [span.slot] * pending
            lists["rows"] += range(pending)
            lists["source"] += range(base + lo, base + lo + pending)
            if lo >= ratio:  # the last complete window ended inside the accepted part of the span
                lists["recorded_slots"].append(span.slot)
                lists["recorded_source"] += range(base + lo - ratio, base + lo)
            else:
                lists["kept_slots"].append(span.slot)
                lists["kept_spans"].append(index)
        plan = {
            name: host_to_device(values, torch.long, self.device) if values else None for name, values in lists.items()
        }
        if plan["recorded_source"] is not None:
            plan["recorded_source"] = plan["recorded_source"].view(-1, ratio)
        return plan

    @staticmethod
    def _rollback_pending(compressor: CompressorTensors, saved: CompressorSnapshot, values, gates, plan: dict):
        """Rebuild the unfinished windows (and, overlapping, the last complete ones) of every rolled-back span from
        the values and gates its forward recorded (``values`` / ``gates``: the records' rows), cut at the
        accepted length."""
        pending_values, pending_gates = compressor.pending
        if plan["slots"] is not None:
            slots, rows, source = plan["slots"], plan["rows"], plan["source"]
            pending_values[slots, rows] = values[source].to(pending_values.dtype)
            pending_gates[slots, rows] = gates[source].to(pending_gates.dtype)
        if compressor.previous is None:
            return
        previous_values, previous_gates = compressor.previous
        if plan["recorded_slots"] is not None:
            slots, source = plan["recorded_slots"], plan["recorded_source"]
            previous_values[slots] = values[source].to(previous_values.dtype)
            previous_gates[slots] = gates[source].to(previous_gates.dtype)
        if plan["kept_slots"] is not None:
            slots, which = plan["kept_slots"], plan["kept_spans"]
            previous_values[slots] = saved.previous[0][which]
            previous_gates[slots] = saved.previous[1][which]


def _journal_rows(journals: list[list] | PaddedJournal, compressor: CompressorTensors, cut: list[int]):
    """The records of the spans ``cut`` for ``compressor`` as rows (values, gates), and where each span's starts."""
    if isinstance(journals, PaddedJournal):
        values, gates = journals.records[id(compressor.journal_key)]
        length = values.shape[1]
        return values.flatten(0, 1), gates.flatten(0, 1), [i * length for i in cut]
    records = [_record(journals[i], compressor) for i in cut]
    bases = list(itertools.accumulate((record[2].shape[0] for record in records), initial=0))[:-1]
    values = torch.cat([record[2] for record in records])
    return values, torch.cat([record[3] for record in records]), bases


def _record(journal: list, compressor: CompressorTensors):
    """The journal's (last) record of ``compressor``'s update: ``(state, first, values, gates)``."""
    for record in reversed(journal):
        if record[0] is compressor.journal_key:
            return record
    raise ValueError("a verify span's journal has no record of a compressor it updated")
