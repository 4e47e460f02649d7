"""Where a fixed-width speculative step's snapshot and rollback read and write, from device tensors alone.

A verify step runs ``width`` = K + 1 new positions of every sequence, replayed from a CUDA graph, so its indexes
come from the sequences' first positions (``starts`` [B]), slots and block tables on the device, never from host
metadata. Two plans, each a handful of integers a sequence:

* ``step_entry_index``: the compressed entries of one ratio a step may write (:class:`EntryIndex`): ``per_row`` =
  ``(ratio - 1 + width) // ratio`` entries from the one the first position falls in, their block (the trash block
  where the step does not complete them) and row in it.
* ``step_ring_rows``: the flat row of every position of the step in every layer of a stack of window rings, each
  in its sequence's slot or, for the positions a rollback keeps, in the spare slot.
* ``step_engram_lookback``: a rollback's V4.1 Engram look-back, rebuilt in place for the sequences it cuts.
* ``step_pending_plan``: where the rollback of one ratio's unfinished compressor windows reads the step's journal
  and writes the states (:class:`PendingPlan`), for sequences that keep positions up to ``kept_end`` [B].

Every value is non-negative, so floor and truncating division agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.engram_rows import ENGRAM_DEAD
from dsinfer.ops.registry import REFERENCE, register


@dataclass
class EntryIndex:
    """Where a fixed-width step may write the entries of one compressor ratio: ``per_row`` entries of each
    sequence from the one its first position falls in; ``owned`` marks those its positions complete."""

    entry_ids: torch.Tensor  # [B, per_row]
    blocks: torch.Tensor  # [B, per_row], the trash block where not owned
    offsets: torch.Tensor  # [B, per_row]
    owned: torch.Tensor  # [B, per_row] bool
    undo_blocks: torch.Tensor | None = None  # [B, per_row]: a rollback's blocks, the trash block where kept


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


def entries_per_row(ratio: int, width: int) -> int:
    """The most entries of ``ratio`` that ``width`` consecutive positions can complete or start."""
    return (ratio - 1 + width) // ratio


@register("step_entry_index", REFERENCE)
def step_entry_index_reference(
    starts: torch.Tensor, block_tables: torch.Tensor, width: int, ratio: int, per_block: int, trash: int,
    kept_end: torch.Tensor | None = None,
) -> EntryIndex:  # fmt: skip
    """:class:`EntryIndex` of sequences whose step covers positions ``starts`` [B] to ``starts + width - 1``, with
    entries of ``ratio`` positions, ``per_block`` to a cache block (``block_tables`` [B, blocks]). ``kept_end`` [B]
    (a rollback's: positions before it stay) adds ``undo_blocks``: the owned entries that only rejected positions
    completed keep their block, every other goes to the trash."""
    table_width = block_tables.shape[1]
    first = starts // ratio
    entry_ids = first[:, None] + torch.arange(entries_per_row(ratio, width), device=starts.device)[None, :]
    owned = entry_ids < ((starts + width) // ratio)[:, None]
    blocks = block_tables.gather(1, (entry_ids // per_block).clamp(max=table_width - 1))
    blocks = torch.where(owned, blocks, trash)
    undo_blocks = None
    if kept_end is not None:
        cut = kept_end < starts + width
        undone = owned & cut[:, None] & (entry_ids >= (kept_end // ratio)[:, None])
        undo_blocks = torch.where(undone, blocks, trash)
    return EntryIndex(entry_ids, blocks, entry_ids % per_block, owned, undo_blocks)


@register("step_ring_rows", REFERENCE)
def step_ring_rows_reference(
    positions: torch.Tensor, slots: torch.Tensor, kept: torch.Tensor | None, spare: int, window: int, layers: int,
    rows_per_layer: int,
) -> torch.Tensor:  # fmt: skip
    """The flat row [B * layers * width] (sequence, then layer, then position) of every position ``positions``
    [B, width] in every layer of a ring stack viewed as rows (``rows_per_layer`` = slots x ``window`` a layer):
    each in its sequence's slot (``slots`` [B]); with ``kept`` [B], the first ``kept`` positions in the ``spare``
    slot instead (a rollback writes back only the others)."""
    chosen = slots[:, None]
    if kept is not None:
        columns = torch.arange(positions.shape[1], device=positions.device)
        chosen = torch.where(columns[None, :] >= kept[:, None], chosen, spare)
    within_layer = chosen * window + positions % window  # [B, width]
    first_rows = torch.arange(layers, device=positions.device) * rows_per_layer
    return (first_rows[None, :, None] + within_layer[:, None, :]).flatten()


@register("step_pending_plan", REFERENCE)
def step_pending_plan_reference(
    starts: torch.Tensor, slots: torch.Tensor, kept_end: torch.Tensor, cut: torch.Tensor, spare: int, ratio: int,
    width: int,
) -> PendingPlan:  # fmt: skip
    """:class:`PendingPlan` of ``ratio`` for sequences in ``slots`` [B] whose step started at ``starts`` [B] and keeps
    positions up to ``kept_end`` [B] (``cut`` [B]: fewer than the step's ``width``). A record holds the positions
    from the first of the window the step started in."""
    length = ratio - 1 + width
    first = starts - starts % ratio
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


@register("step_engram_lookback", REFERENCE)
def step_engram_lookback_reference(
    history: torch.Tensor, context: torch.Tensor, input_ids: torch.Tensor, vocabulary: torch.Tensor,
    image_token_id: int | None, kept: torch.Tensor, cut: torch.Tensor, slots: torch.Tensor,
) -> None:  # fmt: skip
    """The Engram look-back ``history`` [slots, w] after a rollback, in place: for each sequence the step cut
    (``cut`` [B]), the last ``w`` of its look-back before the step (``context`` [B, w], oldest first) and its
    ``kept`` [B] first step tokens (``input_ids`` [B, width]) as compressed ids (``vocabulary``; dead at image
    tokens), into its slot (``slots`` [B]); the other sequences' rows stay."""
    compressed = vocabulary[input_ids]
    if image_token_id is not None:
        compressed = compressed.masked_fill(input_ids == image_token_id, ENGRAM_DEAD)
    joined = torch.cat([context, compressed.to(context.dtype)], dim=1)  # [B, w + width], oldest first
    width = context.shape[1]
    columns = kept[:, None] + torch.arange(width, device=kept.device)[None, :]
    history[slots] = torch.where(cut[:, None], joined.gather(1, columns), history[slots])
