"""``step_entry_index``, ``step_ring_rows``, ``step_pending_plan`` and ``step_engram_lookback`` in one Triton launch
each.

The references are eleven (sixteen with a rollback's undo blocks), four to seven, twenty-two and about ten small
kernels (divisions, remainders, compares, gathers, selects) for a few integers a sequence, issued at every speculative
round's snapshot and rollback; here each plan is one launch: a program takes a tile of sequences (of flat rows,
for the ring rows) and writes every output of the plan. Every value is non-negative, so
C's integer division and remainder (Triton's) are torch's floor ones; outputs take the references' dtypes.
"""

from __future__ import annotations

import torch

from dsinfer.ops.engram_rows import ENGRAM_DEAD
from dsinfer.ops.registry import register
from dsinfer.ops.step_plan.reference import (
    EntryIndex,
    PendingPlan,
    entries_per_row,
    step_engram_lookback_reference,
    step_entry_index_reference,
    step_pending_plan_reference,
    step_ring_rows_reference,
)
from dsinfer.ops.triton_support import tl, triton, triton_available

TILE_VALUES = 4096  # a program's tile: sequences x entries (or window rows), or flat ring rows


if triton is not None:

    @triton.jit
    def _entry_index_kernel(starts_ptr, tables_ptr, kept_end_ptr, ids_ptr, blocks_ptr, offsets_ptr, owned_ptr,
                            undo_ptr, sequences, stride_t0, stride_t1, table_width, per_row, width, ratio, per_block,
                            trash, UNDO: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
        b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        r = tl.arange(0, BLOCK_R)
        inside = (b < sequences)[:, None] & (r < per_row)[None, :]
        start = tl.load(starts_ptr + b, mask=b < sequences, other=0).to(tl.int64)
        ids = (start // ratio)[:, None] + r[None, :]
        owned = ids < ((start + width) // ratio)[:, None]
        column = tl.minimum(ids // per_block, table_width - 1)
        block = tl.load(tables_ptr + b.to(tl.int64)[:, None] * stride_t0 + column * stride_t1, mask=inside, other=0)
        block = tl.where(owned, block, tl.zeros_like(block) + trash)
        out = b.to(tl.int64)[:, None] * per_row + r[None, :]
        tl.store(ids_ptr + out, ids, mask=inside)
        tl.store(blocks_ptr + out, block, mask=inside)
        tl.store(offsets_ptr + out, ids % per_block, mask=inside)
        tl.store(owned_ptr + out, owned.to(tl.uint8), mask=inside)
        if UNDO:
            kept_end = tl.load(kept_end_ptr + b, mask=b < sequences, other=0).to(tl.int64)
            undone = owned & (kept_end < start + width)[:, None] & (ids >= (kept_end // ratio)[:, None])
            tl.store(undo_ptr + out, tl.where(undone, block, tl.zeros_like(block) + trash), mask=inside)

    @triton.jit
    def _ring_rows_kernel(positions_ptr, slots_ptr, kept_ptr, out_ptr, total, width, layers, stride_p, spare,
                          window, rows_per_layer, KEPT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        flat = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = flat < total
        column = flat % width
        b = flat // (width * layers)
        layer = (flat // width) % layers
        position = tl.load(positions_ptr + b * stride_p + column, mask=inside, other=0).to(tl.int64)
        slot = tl.load(slots_ptr + b, mask=inside, other=0).to(tl.int64)
        if KEPT:
            kept = tl.load(kept_ptr + b, mask=inside, other=0).to(tl.int64)
            slot = tl.where(column >= kept, slot, spare)
        tl.store(out_ptr + flat, layer * rows_per_layer + slot * window + position % window, mask=inside)

    @triton.jit
    def _pending_plan_kernel(starts_ptr, slots_ptr, kept_end_ptr, cut_ptr, rows_ptr, pending_source_ptr,
                             pending_targets_ptr, previous_source_ptr, previous_targets_ptr, recorded_ptr, sequences,
                             spare, ratio, width, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
        b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        r = tl.arange(0, BLOCK_R)
        real = b < sequences
        inside = real[:, None] & (r < ratio)[None, :]
        start = tl.load(starts_ptr + b, mask=real, other=0).to(tl.int64)
        kept_end = tl.load(kept_end_ptr + b, mask=real, other=0).to(tl.int64)
        cut = tl.load(cut_ptr + b, mask=real, other=0) != 0
        slot = tl.load(slots_ptr + b, mask=real, other=0)
        length = ratio - 1 + width
        window_start = kept_end - kept_end % ratio
        lo = window_start - (start - start % ratio)
        rows = r.to(tl.int64)[None, :]
        take = cut[:, None] & (rows < (kept_end - window_start)[:, None])
        recorded = cut & (lo >= ratio)
        spare_slot = tl.zeros_like(slot) + spare
        out = b.to(tl.int64)[:, None] * ratio + rows
        tl.store(pending_source_ptr + out, tl.minimum(lo[:, None] + rows, length - 1), mask=inside)
        targets = tl.where(take, slot[:, None], spare_slot[:, None])
        tl.store(pending_targets_ptr + out, targets, mask=inside)
        previous = tl.minimum(tl.maximum(lo[:, None] - ratio + rows, 0), length - 1)
        tl.store(previous_source_ptr + out, previous, mask=inside)
        tl.store(previous_targets_ptr + b, tl.where(cut, slot, spare_slot), mask=real)  # recorded or restored
        tl.store(recorded_ptr + b, recorded.to(tl.uint8), mask=real)
        if tl.program_id(0) == 0:
            tl.store(rows_ptr + r, r.to(tl.int64), mask=r < ratio)

    @triton.jit
    def _engram_lookback_kernel(history_ptr, context_ptr, ids_ptr, vocabulary_ptr, kept_ptr, cut_ptr, slots_ptr,
                                sequences, width, step_width, stride_h, stride_c, stride_i, image_token_id, dead,
                                GATED: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
        b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        r = tl.arange(0, BLOCK_R)
        real = b < sequences
        cut = tl.load(cut_ptr + b, mask=real, other=0) != 0
        inside = (real & cut)[:, None] & (r < width)[None, :]
        kept = tl.load(kept_ptr + b, mask=real, other=0).to(tl.int64)
        slot = tl.load(slots_ptr + b, mask=real, other=0).to(tl.int64)
        column = kept[:, None] + r[None, :]  # in the look-back then the step's tokens, oldest first
        rows = b.to(tl.int64)[:, None]
        earlier = tl.load(context_ptr + rows * stride_c + column, mask=inside & (column < width), other=0)
        step = tl.maximum(column - width, 0)
        token = tl.load(ids_ptr + rows * stride_i + step, mask=inside & (column >= width), other=0)
        compressed = tl.load(vocabulary_ptr + token, mask=inside & (column >= width), other=0)
        if GATED:
            compressed = tl.where(token == image_token_id, dead, compressed)
        value = tl.where(column < width, earlier, compressed.to(earlier.dtype))
        tl.store(history_ptr + slot[:, None] * stride_h + r[None, :], value, mask=inside)


def _tiles(sequences: int, per_sequence: int) -> tuple[int, int, int]:
    """(programs, sequences a program, its padded row width) for ``sequences`` x ``per_sequence`` values."""
    block_r = triton.next_power_of_2(max(per_sequence, 1))
    block_b = min(triton.next_power_of_2(sequences), max(1, TILE_VALUES // block_r))
    return triton.cdiv(sequences, block_b), block_b, block_r


def _integers(*tensors: torch.Tensor) -> bool:
    return all(not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool for t in tensors)


@register("step_entry_index", "triton", devices=("cuda",), available=triton_available, priority=10)
def step_entry_index_triton(
    starts: torch.Tensor, block_tables: torch.Tensor, width: int, ratio: int, per_block: int, trash: int,
    kept_end: torch.Tensor | None = None,
) -> EntryIndex:  # fmt: skip
    """Same contract and result as the reference, one launch."""
    sequences = starts.shape[0]
    args = (starts, block_tables, width, ratio, per_block, trash, kept_end)
    if starts.dim() != 1 or block_tables.dim() != 2 or block_tables.shape[0] != sequences or sequences == 0 \
            or block_tables.shape[1] == 0 or not _integers(starts, block_tables) \
            or (kept_end is not None and (kept_end.shape != starts.shape or not _integers(kept_end))):  # fmt: skip
        return step_entry_index_reference(*args)
    per_row = entries_per_row(ratio, width)
    ids = torch.empty(sequences, per_row, dtype=torch.int64, device=starts.device)  # integer indexes promote to it
    blocks = torch.empty(sequences, per_row, dtype=block_tables.dtype, device=starts.device)
    offsets = torch.empty_like(ids)
    owned = torch.empty(sequences, per_row, dtype=torch.bool, device=starts.device)
    undo = None if kept_end is None else torch.empty_like(blocks)
    programs, block_b, block_r = _tiles(sequences, per_row)
    _entry_index_kernel[(programs,)](
        starts, block_tables, starts if kept_end is None else kept_end, ids, blocks, offsets, owned.view(torch.uint8),
        blocks if undo is None else undo, sequences, block_tables.stride(0), block_tables.stride(1),
        block_tables.shape[1], per_row, int(width), int(ratio), int(per_block), int(trash), UNDO=undo is not None,
        BLOCK_B=block_b, BLOCK_R=block_r, num_warps=4,
    )  # fmt: skip
    return EntryIndex(ids, blocks, offsets, owned, undo)


@register("step_ring_rows", "triton", devices=("cuda",), available=triton_available, priority=10)
def step_ring_rows_triton(
    positions: torch.Tensor, slots: torch.Tensor, kept: torch.Tensor | None, spare: int, window: int, layers: int,
    rows_per_layer: int,
) -> torch.Tensor:  # fmt: skip
    """Same contract and result as the reference, one launch."""
    args = (positions, slots, kept, spare, window, layers, rows_per_layer)
    sequences = slots.shape[0]
    if positions.dim() != 2 or positions.shape[0] != sequences or positions.stride(1) != 1 or slots.dim() != 1 \
            or not _integers(positions, slots) or (kept is not None and kept.shape != slots.shape):  # fmt: skip
        return step_ring_rows_reference(*args)
    width = positions.shape[1]
    total = sequences * layers * width
    out = torch.empty(total, dtype=torch.int64, device=positions.device)
    if total:
        block = min(1024, triton.next_power_of_2(total))
        _ring_rows_kernel[(triton.cdiv(total, block),)](
            positions, slots, slots if kept is None else kept, out, total, width, layers, positions.stride(0),
            int(spare), int(window), int(rows_per_layer), KEPT=kept is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


@register("step_pending_plan", "triton", devices=("cuda",), available=triton_available, priority=10)
def step_pending_plan_triton(
    starts: torch.Tensor, slots: torch.Tensor, kept_end: torch.Tensor, cut: torch.Tensor, spare: int, ratio: int,
    width: int,
) -> PendingPlan:  # fmt: skip
    """Same contract and result as the reference, one launch."""
    sequences = starts.shape[0]
    shapes_ok = all(t.dim() == 1 and t.shape[0] == sequences for t in (starts, slots, kept_end, cut))
    if not shapes_ok or sequences == 0 or cut.dtype != torch.bool or not _integers(starts, slots, kept_end):
        return step_pending_plan_reference(starts, slots, kept_end, cut, spare, ratio, width)
    device = starts.device
    rows = torch.empty(ratio, dtype=torch.int64, device=device)
    pending_source = torch.empty(sequences, ratio, dtype=torch.int64, device=device)  # integer indexes promote to it
    pending_targets = torch.empty(sequences, ratio, dtype=slots.dtype, device=device)
    previous_source = torch.empty_like(pending_source)
    previous_targets = torch.empty(sequences, dtype=slots.dtype, device=device)
    recorded = torch.empty(sequences, dtype=torch.bool, device=device)
    programs, block_b, block_r = _tiles(sequences, ratio)
    _pending_plan_kernel[(programs,)](
        starts, slots, kept_end, cut.view(torch.uint8), rows, pending_source, pending_targets, previous_source,
        previous_targets, recorded.view(torch.uint8), sequences, int(spare), int(ratio), int(width),
        BLOCK_B=block_b, BLOCK_R=block_r, num_warps=4,
    )  # fmt: skip
    return PendingPlan(rows, pending_source, pending_targets, previous_source, previous_targets, recorded)


@register("step_engram_lookback", "triton", devices=("cuda",), available=triton_available, priority=10)
def step_engram_lookback_triton(
    history: torch.Tensor, context: torch.Tensor, input_ids: torch.Tensor, vocabulary: torch.Tensor,
    image_token_id: int | None, kept: torch.Tensor, cut: torch.Tensor, slots: torch.Tensor,
) -> None:  # fmt: skip
    """Same contract and effect as the reference, one launch."""
    args = (history, context, input_ids, vocabulary, image_token_id, kept, cut, slots)
    sequences = context.shape[0]
    shapes_ok = context.dim() == 2 and history.dim() == 2 and input_ids.dim() == 2 and vocabulary.dim() == 1 and all(
        t.dim() == 1 and t.shape[0] == sequences for t in (kept, cut, slots))  # fmt: skip
    if not shapes_ok or sequences == 0 or history.shape[1] != context.shape[1] or cut.dtype != torch.bool \
            or history.dtype != context.dtype or history.stride(1) != 1 or context.stride(1) != 1 \
            or input_ids.stride(1) != 1 or not _integers(history, input_ids, vocabulary, kept, slots):  # fmt: skip
        return step_engram_lookback_reference(*args)
    width = context.shape[1]
    programs, block_b, block_r = _tiles(sequences, width)
    _engram_lookback_kernel[(programs,)](
        history, context, input_ids, vocabulary, kept, cut.view(torch.uint8), slots, sequences, width,
        input_ids.shape[1], history.stride(0), context.stride(0), input_ids.stride(0),
        -1 if image_token_id is None else int(image_token_id), ENGRAM_DEAD, GATED=image_token_id is not None,
        BLOCK_B=block_b, BLOCK_R=block_r, num_warps=4,
    )  # fmt: skip
