"""RMSNorm in one Triton kernel: each program normalises whole rows in registers.

The torch reference runs five or six kernels per call (cast to float32, square, mean, rsqrt, two products, cast
back), each a pass over the rows: at decode sizes their launches are the cost (33 norms a step on the 4-layer
V4-Flash slice), at prefill sizes their memory traffic (a float32 copy of every row, written and read again).
Here one launch reads each row once and writes it once. The sum of squares runs in another order than torch's
mean, so float32 results may differ in the last bits; after rounding to bf16 they agree within one bf16 step
(tests/ops bind both to the reference).
"""

from __future__ import annotations

import os

import torch

from dsinfer.ops.norm_rope.reference import rms_norm_reference
from dsinfer.ops.registry import register

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

MAX_ROW = 16384  # widest row one program holds in registers; wider rows take the reference


def rms_norm_triton_available() -> bool:
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(src, weight, dst, rows, width, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        column = tl.arange(0, BLOCK)
        mask = (row < rows)[:, None] & (column < width)[None, :]
        offsets = row.to(tl.int64)[:, None] * width + column[None, :]
        x = tl.load(src + offsets, mask=mask, other=0.0).to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / width + eps)
        w = tl.load(weight + column, mask=column < width, other=0.0).to(tl.float32)
        y = w[None, :] * (x * scale[:, None])
        tl.store(dst + offsets, y.to(dst.dtype.element_ty), mask=mask)


@register("rms_norm", "triton", devices=("cuda",), available=rms_norm_triton_available, priority=10)
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as :func:`rms_norm_reference`; rows wider than ``MAX_ROW`` go to it."""
    width = x.shape[-1]
    if width > MAX_ROW or width == 0 or weight.shape != (width,):
        return rms_norm_reference(x, weight, eps)
    flat = x.reshape(-1, width)
    if flat.stride(-1) != 1 or flat.stride(0) != width:
        flat = flat.contiguous()
    out = torch.empty_like(flat)
    rows = flat.shape[0]
    if rows:
        block = triton.next_power_of_2(width)
        per_program = max(1, min(16, 2048 // block))  # narrow rows (head norms): several rows a program
        grid = (triton.cdiv(rows, per_program),)
        _rms_norm_kernel[grid](
            flat, weight.contiguous(), out, rows, width, eps, ROWS=per_program, BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
        )  # fmt: skip
    return out.view(x.shape)
