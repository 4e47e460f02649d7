"""RMSNorm, with and without a weight, in one Triton kernel: each program normalises whole rows in registers.

The torch reference runs five or six kernels per call (cast to float32, square, mean, rsqrt, two products, cast
back), each a pass over the rows: at decode sizes their launches are the cost (33 norms a step on the 4-layer
V4-Flash slice), at prefill sizes their memory traffic (a float32 copy of every row, written and read again).
Here one launch reads each row once and writes it once. The sum of squares runs in another order than torch's
mean, so float32 results may differ in the last bits; after rounding to bf16 they agree within one bf16 step
(tests/ops bind both to the reference).
"""

from __future__ import annotations

import math

import torch

from dsinfer.ops.dependent_launch import dependent_launch
from dsinfer.ops.norm_rope.reference import rms_norm_reference, rms_normalize_reference
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

if triton is not None:
    from dsinfer.ops.dependent_launch import allow_dependents

MAX_ROW = 16384  # widest row one program holds in registers; wider rows take the reference


if triton is not None:

    @triton.jit
    def _program_rows(src, rows, width, inner, stride_outer, stride_inner, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """This program's rows of ``src`` (read at their strides, masked), the mask and their offsets in the output."""
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        column = tl.arange(0, BLOCK)
        mask = (row < rows)[:, None] & (column < width)[None, :]
        offsets = row.to(tl.int64)[:, None] * width + column[None, :]
        start = (row // inner).to(tl.int64) * stride_outer + (row % inner).to(tl.int64) * stride_inner
        return tl.load(src + start[:, None] + column[None, :], mask=mask, other=0.0), mask, offsets

    @triton.jit
    def _rms_norm_kernel(
        src, weight, dst, rows, width, inner, stride_outer, stride_inner, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        allow_dependents(PDL)
        x, mask, offsets = _program_rows(src, rows, width, inner, stride_outer, stride_inner, ROWS, BLOCK)
        x = x.to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / width + eps)
        column = tl.arange(0, BLOCK)
        w = tl.load(weight + column, mask=column < width, other=0.0).to(tl.float32)
        y = w[None, :] * (x * scale[:, None])
        tl.store(dst + offsets, y.to(dst.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_normalize_kernel(
        src, dst, rows, width, inner, stride_outer, stride_inner, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        allow_dependents(PDL)
        x, mask, offsets = _program_rows(src, rows, width, inner, stride_outer, stride_inner, ROWS, BLOCK)
        x32 = x.to(tl.float32)
        # The reference rounds the scale to the rows' dtype and multiplies in it (one rounding of the product).
        scale = (1.0 / tl.sqrt(tl.sum(x32 * x32, axis=1) / width + eps)).to(x.dtype).to(tl.float32)
        tl.store(dst + offsets, (x32 * scale[:, None]).to(dst.dtype.element_ty), mask=mask)


def row_layout(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [N, M, width] rows of its last axis (M: its middle axes, 1 for a 2-D x), unit channel stride: a
    view of ``x`` where its strides allow (a column slice of a wider GEMM output, or that slice viewed as [T, heads,
    head_dim]; the kernels read it in place), else one contiguous copy. A token's M rows stay together."""
    width = x.shape[-1]
    shape = (x.shape[0] if x.dim() > 1 else 1, math.prod(x.shape[1:-1]), width)
    if x.stride(-1) == 1 or width == 1:
        try:
            return x.view(shape)
        except RuntimeError:
            pass
    return x.contiguous().view(shape)


def norm_launch_shape(width: int) -> tuple[int, int, int]:
    """(block, rows per program, warps): narrow rows (head norms) take several rows a program."""
    block = triton.next_power_of_2(width)
    return block, max(1, min(16, 2048 // block)), 4 if block <= 2048 else 8


def _normalize_rows(kernel, x: torch.Tensor, eps: float, *weight: torch.Tensor) -> torch.Tensor:
    """Launch ``kernel`` (either norm) over ``x``'s rows as :func:`row_layout` gives them; a new contiguous tensor."""
    width = x.shape[-1]
    rows3 = row_layout(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = out.numel() // width
    if rows:
        block, per_program, warps = norm_launch_shape(width)
        kernel[(triton.cdiv(rows, per_program),)](
            rows3, *weight, out, rows, width, rows3.shape[1], rows3.stride(0), rows3.stride(1), eps,
            PDL=dependent_launch(x.device), ROWS=per_program, BLOCK=block, num_warps=warps,
        )  # fmt: skip
    return out


@register("rms_normalize", "triton", devices=("cuda",), available=triton_available, priority=10)
def rms_normalize_triton(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as :func:`rms_normalize_reference`; rows wider than ``MAX_ROW`` go to it."""
    width = x.shape[-1]
    if width > MAX_ROW or width == 0 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return rms_normalize_reference(x, eps)
    return _normalize_rows(_rms_normalize_kernel, x, eps)


@register("rms_norm", "triton", devices=("cuda",), available=triton_available, priority=10)
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as :func:`rms_norm_reference`; rows wider than ``MAX_ROW`` go to it."""
    width = x.shape[-1]
    if width > MAX_ROW or width == 0 or weight.shape != (width,):
        return rms_norm_reference(x, weight, eps)
    return _normalize_rows(_rms_norm_kernel, x, eps, weight.contiguous())
