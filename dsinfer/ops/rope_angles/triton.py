"""``rope_angles`` in one Triton launch: the reference is a product, a cos and a sin (and, for a compressor's group
angles, a remainder and a difference), three to five launches for a decode step's few rows, once per set of
angles of each step.

Every value is the reference's: the position is converted to float32 and multiplied by the float32 frequency (one
rounding, as torch's product), and ``tl.cos`` / ``tl.sin`` are the CUDA math library's accurate ``cosf`` /
``sinf`` that torch's kernels call. The group's first position is ``p - p mod ratio`` with the remainder taken
as Python (and torch) take it, never negative.
"""

from __future__ import annotations

import torch

from dsinfer.ops.dependent_launch import dependent_launch
from dsinfer.ops.registry import register
from dsinfer.ops.rope_angles.reference import rope_angles_reference
from dsinfer.ops.triton_support import tl, triton, triton_available

if triton is not None:
    from dsinfer.ops.dependent_launch import allow_dependents

ROWS_PER_PROGRAM = 16


if triton is not None:

    @triton.jit
    def _rope_angles_kernel(
        positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr, rows, ratio, HALF: tl.constexpr, BLOCK: tl.constexpr,
        ROWS: tl.constexpr, GROUPED: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        allow_dependents(PDL)
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        channel = tl.arange(0, BLOCK)
        row_ok = row < rows
        channel_ok = channel < HALF
        position = tl.load(positions_ptr + row, mask=row_ok, other=0)
        if GROUPED:
            remainder = position % ratio
            position = position - tl.where(remainder < 0, remainder + ratio, remainder)
        freq = tl.load(inv_freq_ptr + channel, mask=channel_ok, other=0.0)
        angle = position.to(tl.float32)[:, None] * freq[None, :]
        at = row.to(tl.int64)[:, None] * HALF + channel[None, :]
        ok = row_ok[:, None] & channel_ok[None, :]
        tl.store(cos_ptr + at, tl.cos(angle), mask=ok)
        tl.store(sin_ptr + at, tl.sin(angle), mask=ok)


@register("rope_angles", "triton", devices=("cuda",), available=triton_available, priority=10)
def rope_angles_triton(
    positions: torch.Tensor, inv_freq: torch.Tensor, ratio: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and values as ``rope_angles_reference``; inputs the kernel does not take go to the reference."""
    integer = not positions.is_floating_point() and positions.dtype != torch.bool
    takes = (
        (integer or positions.dtype == torch.float32) and inv_freq.dim() == 1 and inv_freq.dtype == torch.float32
        and inv_freq.device == positions.device and ratio >= 1 and (integer or ratio == 1)
    )  # fmt: skip
    if not takes:
        return rope_angles_reference(positions, inv_freq, ratio)
    flat = positions.reshape(-1).contiguous()
    half = inv_freq.shape[0]
    cos = torch.empty(flat.shape[0], half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if flat.numel() and half:
        grid = (triton.cdiv(flat.numel(), ROWS_PER_PROGRAM),)
        _rope_angles_kernel[grid](
            flat, inv_freq.contiguous(), cos, sin, flat.numel(), int(ratio), HALF=half,
            BLOCK=triton.next_power_of_2(half), ROWS=ROWS_PER_PROGRAM, GROUPED=ratio > 1,
            PDL=dependent_launch(positions.device), num_warps=1,
        )  # fmt: skip
    shape = (*positions.shape, half)
    return cos.view(shape), sin.view(shape)
