"""``decode_entry_location`` in one Triton launch: each sequence's block-table block (or the trash block) and row
for its decode entry.

The reference is six small kernels (a division, a clamp, a gather, a fill, a select, a remainder) for a handful of
integers per decode step; one program reads every sequence's entry id, its block-table slot and its completion
flag and writes both results. Entry ids are never negative, so C's integer division and remainder (Triton's) are
torch's floor ones.
"""

from __future__ import annotations

import torch

from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

MAX_SEQUENCES = 4096


if triton is not None:

    @triton.jit
    def _location_kernel(
        tables_ptr,
        entry_ptr,
        complete_ptr,
        block_ptr,
        row_ptr,
        sequences,
        width,
        stride_t0,
        stride_t1,
        stride_e,
        stride_c,
        per_block,
        trash,
        COMPLETE: tl.constexpr,
        BLOCK_B: tl.constexpr,
    ):
        b = tl.arange(0, BLOCK_B)
        ok = b < sequences
        entry = tl.load(entry_ptr + b * stride_e, mask=ok, other=0).to(tl.int64)
        column = tl.minimum(entry // per_block, width - 1)
        block = tl.load(tables_ptr + b.to(tl.int64) * stride_t0 + column * stride_t1, mask=ok, other=0)
        if COMPLETE:
            done = tl.load(complete_ptr + b * stride_c, mask=ok, other=0)
            block = tl.where(done != 0, block, tl.zeros_like(block) + trash)
        tl.store(block_ptr + b, block, mask=ok)
        tl.store(row_ptr + b, (entry % per_block).to(row_ptr.dtype.element_ty), mask=ok)


def serves(block_tables: torch.Tensor, entry: torch.Tensor, complete: torch.Tensor | None) -> bool:
    """Whether the kernel takes these inputs (else :func:`decode_entry_location_triton` runs the reference)."""
    if block_tables.dim() != 2 or entry.dim() != 1 or block_tables.is_floating_point() or entry.is_floating_point():
        return False
    sequences = entry.shape[0]
    if block_tables.shape[0] != sequences or block_tables.shape[1] == 0 or not 0 < sequences <= MAX_SEQUENCES:
        return False
    return complete is None or (complete.shape == (sequences,) and complete.dtype == torch.bool)


@register("decode_entry_location", "triton", devices=("cuda",), available=triton_available, priority=10)
def decode_entry_location_triton(
    block_tables: torch.Tensor, entry: torch.Tensor, complete: torch.Tensor | None, per_block: int, trash: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``decode_entry_location`` (the reference)."""
    if not serves(block_tables, entry, complete):
        from dsinfer.ops.compressor.reference import decode_entry_location

        return decode_entry_location(block_tables, entry, complete, per_block, trash)
    sequences = entry.shape[0]
    block = torch.empty(sequences, dtype=block_tables.dtype, device=entry.device)
    row = torch.empty(sequences, dtype=entry.dtype, device=entry.device)
    flags = complete.view(torch.uint8) if complete is not None else entry
    _location_kernel[(1,)](
        block_tables, entry, flags, block, row, sequences, block_tables.shape[1], block_tables.stride(0),
        block_tables.stride(1), entry.stride(0), flags.stride(0), int(per_block), int(trash),
        COMPLETE=complete is not None, BLOCK_B=triton.next_power_of_2(sequences), num_warps=1,
    )  # fmt: skip
    return block, row
