"""Verify steps of fixed width: every sequence its last token and K drafts, as device tensors alone.

A verify step runs every sequence's last token and its drafts: ``width`` = K + 1 positions per sequence, the
same for all of them (:class:`FixedWidthBatch`). The model runs everything that is per token (embedding,
projections, mHC, MoE, Engram, the head) once over all ``B * width`` rows. In the attention the compressors add
one column at a time (column ``j`` holds position ``start + j`` of every sequence), then the indexer chooses and
one decode op attends for every row at once (:meth:`FixedWidthBatch.all_rows`), each row over the window of its
own position: the positions before the step from the ring, the step's own from its rows
(:meth:`FixedWidthBatch.step_origin`), so each position sees the ring and the entries exactly as a plain decode
step of that position would (a drafter's batch with ``row_slots`` still attends column by column). No shape
depends on a device value and no metadata is built on the host, so the whole forward can be captured once per
batch bucket and replayed.

Rollback needs what every compressor's unfinished window held before the step and what each column added to
it: :class:`PendingJournal` gathers both into one padded tensor per compressor (the records of the rollback's
padded journal: the eager path's per-span journal at fixed width).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dsinfer.kv.batch import DeviceSpans, PackedBatch, SequenceSpan
from dsinfer.kv.cache_v4 import KVCache
from dsinfer.kv.cache_v41 import KVCacheV41


@dataclass
class StepOrigin:
    """Where each packed row's sequence's step starts, for a decode op reading the step's rows beside the ring:
    ``starts`` [B * width] (the sequence's first step position) and ``first_rows`` [B * width] (that position's
    packed row)."""

    starts: torch.Tensor
    first_rows: torch.Tensor


@dataclass
class FixedWidthBatch:
    """``B`` sequences of exactly ``width`` new positions each (consecutive from ``starts``), as device tensors.

    Rows past the real sequences are padding: the spare slot, start 0, block tables of the trash block only,
    so they touch nothing a sequence owns. ``row_slots`` gives each position its own slot (a drafter runs a
    sequence's rejected positions in the spare slot); None: every position in its sequence's slot."""

    input_ids: torch.Tensor  # [B, width]
    starts: torch.Tensor  # [B] position of each sequence's first new token
    slots: torch.Tensor  # [B]
    window_from: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, table_width], padded with the trash block
    cache: KVCache | KVCacheV41
    spare_slot: int
    row_slots: torch.Tensor | None = None  # [B, width]
    positions: torch.Tensor = field(init=False)  # [B, width]
    # Each column contiguous, as kernels read their index tensors: [width, B].
    column_positions: torch.Tensor = field(init=False)
    column_ids: torch.Tensor = field(init=False)
    column_slots: torch.Tensor | None = field(init=False)
    _all_rows: PackedBatch | None = field(init=False, default=None, repr=False)
    _step_origin: StepOrigin | None = field(init=False, default=None, repr=False)
    _columns: dict[int, PackedBatch] = field(init=False, default_factory=dict, repr=False)
    _sequence_rows: torch.Tensor | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        self.positions = self.starts[:, None] + torch.arange(self.width, device=self.starts.device)
        self.column_positions = self.positions.t().contiguous()
        self.column_ids = self.input_ids.t().contiguous()
        self.column_slots = None if self.row_slots is None else self.row_slots.t().contiguous()

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def sequence_rows(self) -> torch.Tensor:
        """``arange(B)`` on the device, made once a forward: the columns, the packed batch and the step origin
        share it."""
        if self._sequence_rows is None:
            self._sequence_rows = torch.arange(self.size, device=self.starts.device)
        return self._sequence_rows

    def packed(self, journal: PendingJournal | None = None) -> PackedBatch:
        """The whole batch as a packed batch (sequence after sequence) with its device spans; the host spans say
        only the lengths, which is all the model's per-token code reads of them. The packed batch names this one
        (``fixed_width``), so its attention runs column by column, recording compressor updates in ``journal``
        (None: only window-only layers run, as in an MTP draft)."""
        size, width = self.size, self.width
        spans = [SequenceSpan(0, width, self.spare_slot, []) for _ in range(size)]
        batch = PackedBatch(self.input_ids.flatten(), self.positions.flatten(), spans, self.cache)
        last_rows = self.sequence_rows * width + (width - 1)
        batch._device_spans = DeviceSpans(self.slots, self.starts, self.window_from, self.block_tables, last_rows)
        batch.fixed_width, batch.column_journal = self, journal
        return batch

    def column(self, index: int) -> PackedBatch:
        """Column ``index`` (position ``start + index`` of every sequence) as a decode-shaped batch, built once a
        forward: every layer's columns share it, and with it the RoPE angles of its positions."""
        if index not in self._columns:
            slots = self.slots if self.column_slots is None else self.column_slots[index]
            self._columns[index] = self.decode_batch(self.column_positions[index], self.column_ids[index], slots)
        return self._columns[index]

    def decode_batch(
        self, positions: torch.Tensor, input_ids: torch.Tensor, slots: torch.Tensor | None = None
    ) -> PackedBatch:
        """A decode-shaped batch of the same sequences: one position each (``positions`` [B]), in ``slots``
        (default: their own)."""
        spans = [SequenceSpan(0, 1, self.spare_slot, []) for _ in range(self.size)]
        batch = PackedBatch(input_ids, positions, spans, self.cache)
        slots = self.slots if slots is None else slots
        batch._device_spans = DeviceSpans(slots, positions, self.window_from, self.block_tables, self.sequence_rows)
        return batch

    def all_rows(self) -> PackedBatch:
        """Every position as a decode-shaped row, in the packed batch's order ([B * width], sequence after
        sequence), each in its sequence's slot, with its sequence's table and window start."""
        if self._all_rows is None:
            width, positions = self.width, self.positions.flatten()
            spans = [SequenceSpan(0, 1, self.spare_slot, []) for _ in range(self.size * width)]
            batch = PackedBatch(self.input_ids.flatten(), positions, spans, self.cache)
            rows = torch.arange(positions.shape[0], device=positions.device)
            tables = self.block_tables.repeat_interleave(width, dim=0)
            batch._device_spans = DeviceSpans(self.slots.repeat_interleave(width), positions,
                                              self.window_from.repeat_interleave(width), tables, rows)  # fmt: skip
            self._all_rows = batch
        return self._all_rows

    def step_origin(self) -> StepOrigin:
        """Each packed row's sequence's first step position and its row (:class:`StepOrigin`), once a forward:
        every layer shares it."""
        if self._step_origin is None:
            width = self.width
            first_rows = self.sequence_rows * width
            self._step_origin = StepOrigin(self.starts.repeat_interleave(width), first_rows.repeat_interleave(width))
        return self._step_origin

    def columns(self, rows: torch.Tensor) -> torch.Tensor:
        """A per-row tensor [B * width, ...] as [width, B, ...]: column ``j`` contiguous."""
        return rows.view(self.size, self.width, *rows.shape[1:]).transpose(0, 1).contiguous()

    def rows(self, columns: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`columns`: [width, B, ...] back to [B * width, ...], sequence after sequence."""
        return columns.transpose(0, 1).reshape(-1, *columns.shape[2:])


class PendingJournal:
    """Each compressor's unfinished window before the step and every column's addition to it, joined per sequence
    into the record rollback reads: positions from the first of the window the span starts in through its end.
    ``into`` (by ``id(state)``: values and gates [B, ...]) takes the records in place, as a graph's static
    buffers do; without it each record is a tensor of its own."""

    def __init__(self, batch: FixedWidthBatch, into: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None):
        self.batch, self.into = batch, into
        self.records: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._offsets: dict[int, torch.Tensor] = {}  # per ratio, shared by the layers: each position's window row
        self._orders: dict[int, torch.Tensor] = {}  # per ratio, shared by the layers: the records' row order

    def offsets(self, ratio: int) -> torch.Tensor:
        """Each position's row in its ``ratio``-row window [B, width], once a forward."""
        if ratio not in self._offsets:
            self._offsets[ratio] = self.batch.positions % ratio
        return self._offsets[ratio]

    def before(self, states: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The unfinished windows of the batch's slots [B, ratio, width] (before the layer's columns run)."""
        slots = self.batch.slots
        return [(state.pending_values[slots], state.pending_gates[slots]) for state in states]

    def column(self, states: list, column: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """What column ``column`` wrote into each unfinished window [B, width] (its position's row)."""
        return self._window_rows(states, self.batch.slots, column)

    def step_rows(self, states: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """What every column wrote into each unfinished window [B, width, width of a row], read once after the
        columns ran: valid where :meth:`rows_survive_the_step`."""
        return self._window_rows(states, self.batch.slots[:, None], slice(None))

    def _window_rows(self, states: list, slots: torch.Tensor, columns) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each state's values and gates at the window rows of ``columns`` (an index or a slice) in ``slots``."""
        rows = []
        for state in states:
            at = self.offsets(state.ratio)[:, columns]
            rows.append((state.pending_values[slots, at], state.pending_gates[slots, at]))
        return rows

    def rows_survive_the_step(self, states: list) -> bool:
        """Whether every column's row is still in its window once all columns ran: the columns run in their
        sequences' slots, and a window holds at least ``width`` rows, so the step's positions fall in distinct rows
        of it (a completed window's rows stay until overwritten)."""
        return self.batch.row_slots is None and all(state.ratio >= self.batch.width for state in states)

    def run_columns(self, states: list, update: Callable[[int], Any]) -> list:
        """``update(j)`` for every column ``j`` in position order, what each writes into the unfinished windows of
        ``states`` recorded (:meth:`before`, then :meth:`step_rows` once after the columns where the rows survive
        the step, else :meth:`column` after each; :meth:`close`; nothing without states); the updates' results in
        column order."""
        width = self.batch.width
        if not states:
            return [update(j) for j in range(width)]
        before = self.before(states)
        if self.rows_survive_the_step(states):
            results = [update(j) for j in range(width)]
            written = self.step_rows(states)
        else:
            results, by_column = [], []
            for j in range(width):
                results.append(update(j))
                by_column.append(self.column(states, j))
            written = [tuple(torch.stack([rows[index][part] for rows in by_column], dim=1) for part in range(2))
                       for index in range(len(states))]  # fmt: skip
        self.close(states, before, written)
        return results

    def close(self, states: list, before: list, written: list) -> None:
        """Join each state's window before the step with the columns' rows (``written``: per state, values and gates
        [B, width, ...]) into its record [B, ratio - 1 + width, ...]; the rows' order is worked out once a ratio
        and forward."""
        batch, sources = self.batch, self._orders
        for index, state in enumerate(states):
            ratio = state.ratio
            if ratio not in sources:
                offset = (batch.starts % ratio)[:, None]  # rows of the window before the span's first position
                place = torch.arange(ratio - 1 + batch.width, device=offset.device)[None, :]
                source = torch.where(place < offset, place, ratio + place - offset).clamp(max=ratio + batch.width - 1)
                sources[ratio] = source[..., None]
            joined = []
            for part in range(2):
                both = torch.cat([before[index][part], written[index][part]], dim=1)
                order = sources[ratio].expand(-1, -1, both.shape[-1])
                out = None if self.into is None else self.into[id(state)][part]
                joined.append(both.gather(1, order) if out is None else torch.gather(both, 1, order, out=out))
            self.records[id(state)] = (joined[0], joined[1])
