"""``rms_normalize_rope``: the query's weightless RMSNorm and its RoPE in one Triton pass over the rows.

Unfused, a prefill's [T, 64, 512] bf16 queries are read and written by the norm, then their rope channels read
and written again by the rotation (about 75 us of a 4,096-token chunk per layer on an H200). Here each program
loads whole rows (one head each) once, normalises them, rotates the rope channels of the normalised rows and
stores each row once.

In bf16 and fp16 (the engine's dtypes) the unfused Triton kernels' results bit for bit (measured on the H200),
and in every dtype within the norm kernel's tolerance of the reference: the sum of squares in float32, the scale
rounded to x's dtype, the row multiplied by it and rounded (the norm's output), and the rope pairs of that
rounded row rotated in float32 without fused multiply-adds (``enable_fp_fusion=False``), as the ``rope`` kernel
does. In float32 the compiler may order the row's sum differently from the norm kernel's (last-bit differences).

Rows are read at their strides (a [T, heads, head_dim] view of a joined GEMM's columns is not copied); the output
is a new contiguous tensor. Inputs the kernel does not take go to the reference.
"""

from __future__ import annotations

import torch

from dsinfer.ops.norm_rope.reference import rms_normalize_rope_reference
from dsinfer.ops.norm_rope.rms_norm_triton import MAX_ROW, norm_launch_shape, rms_norm_triton_available, row_layout
from dsinfer.ops.norm_rope.rope_triton import serves
from dsinfer.ops.registry import register

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


if triton is not None:

    @triton.jit
    def _normalize_rope_kernel(
        src,
        cos_ptr,
        sin_ptr,
        dst,
        rows,
        width,
        inner,  # rows per token (heads): a token's rows share its angles
        stride_outer,
        stride_inner,
        stride_cn,
        stride_cc,
        stride_sn,
        stride_sc,
        eps,
        NOPE: tl.constexpr,  # channels before the rope slice (even)
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,  # next power of two of width
    ):
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = row < rows
        column = tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (column < width)[None, :]
        token = (row // inner).to(tl.int64)
        start = token * stride_outer + (row % inner).to(tl.int64) * stride_inner
        x = tl.load(src + start[:, None] + column[None, :], mask=mask, other=0.0)
        x32 = x.to(tl.float32)
        scale = (1.0 / tl.sqrt(tl.sum(x32 * x32, axis=1) / width + eps)).to(x.dtype).to(tl.float32)
        normed = (x32 * scale[:, None]).to(x.dtype).to(tl.float32)  # the norm's output, rounded as it stores it

        # Channel pairs (2j, 2j + 1); pairs from NOPE // 2 on rotate by the token's angle j - NOPE // 2.
        even, odd = tl.split(tl.reshape(normed, [ROWS, BLOCK // 2, 2]))
        pair = tl.arange(0, BLOCK // 2)
        rotates = (pair >= NOPE // 2) & (2 * pair < width)
        angle = tl.where(rotates, pair - NOPE // 2, 0)
        angle_mask = row_ok[:, None] & rotates[None, :]
        cos = tl.load(cos_ptr + token[:, None] * stride_cn + angle[None, :] * stride_cc, mask=angle_mask, other=1.0)
        sin = tl.load(sin_ptr + token[:, None] * stride_sn + angle[None, :] * stride_sc, mask=angle_mask, other=0.0)
        new_even = tl.where(rotates[None, :], even * cos - odd * sin, even)
        new_odd = tl.where(rotates[None, :], even * sin + odd * cos, odd)
        out = tl.reshape(tl.join(new_even, new_odd), [ROWS, BLOCK])
        offsets = row.to(tl.int64)[:, None] * width + column[None, :]
        tl.store(dst + offsets, out.to(dst.dtype.element_ty), mask=mask)


def takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs: [N, ..., dim] rows of an even width up to MAX_ROW with an even
    nope part, angles the ``rope`` kernel would take for one token each."""
    return serves(x, cos, sin) and 0 < x.shape[-1] <= MAX_ROW and x.shape[-1] % 2 == 0


@register("rms_normalize_rope", "triton", devices=("cuda",), available=rms_norm_triton_available, priority=10)
def rms_normalize_rope_triton(x: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`rms_normalize_rope_reference`; in bf16 / fp16 the unfused Triton kernels' results."""
    if not takes(x, cos, sin):
        return rms_normalize_rope_reference(x, eps, cos, sin)
    width, half = x.shape[-1], cos.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = out.numel() // width
    if rows == 0:
        return out
    tokens = x.shape[0]
    rows3 = row_layout(x)  # [tokens, heads, width]: a token's rows share its angles
    cos, sin = cos.expand(tokens, half), sin.expand(tokens, half)  # one token's angles for all: stride 0
    block, per_program, warps = norm_launch_shape(width)
    _normalize_rope_kernel[(triton.cdiv(rows, per_program),)](
        rows3, cos, sin, out, rows, width, rows3.shape[1], rows3.stride(0), rows3.stride(1),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), eps,
        NOPE=width - 2 * half, ROWS=per_program, BLOCK=block, num_warps=warps,
        enable_fp_fusion=False,  # no fused multiply-add: the rope kernel's roundings, bit for bit
    )  # fmt: skip
    return out
