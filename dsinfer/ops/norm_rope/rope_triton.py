"""The ``rope`` op in one Triton kernel: the nope channels copied and the rope channels rotated in one pass.

The torch reference slices, casts, multiplies, stacks, flattens and concatenates: about ten kernels per call,
and the concatenation copies every query and key once more. In a prefill the queries are [T, 64 heads, 512]
bf16 with a 64-channel rope slice, so that traffic, not the arithmetic, is the cost. Here each program reads a
block of rows once and writes the whole output row: the nope channels unchanged, the rope channel pairs rotated.

Bit-identical to the reference: the pairs are rotated in float32 as ``even * cos - odd * sin`` and
``even * sin + odd * cos`` (``sin`` negated for ``inverse``, which is exact), each product and sum rounded to
float32 as torch does, then rounded once to ``x``'s dtype. The kernel is compiled with ``enable_fp_fusion=False``:
with fusion the compiler contracts ``a * b - c * d`` into a fused multiply-add, which skips one rounding and can
change the last float32 bit (and, rarely, the bf16 result). The kernel is memory-bound, so the unfused
multiplies cost nothing measurable.

With ``in_place`` (a contiguous x the caller owns) the kernel rewrites only the rope channels of x: a prefill's
[T, 64, 512] queries are then read and written at 64 of their 512 channels instead of copied whole.

Rows are x's leading axes flattened: [N, ..., dim] is viewed as [N, M, dim] (a view where the strides allow,
else one copy), and the angles of token ``n`` are shared by its M rows. Inputs the kernel does not take (an
x of rank < 2, angles that are not float32 [N, rope_dim // 2] or [1, rope_dim // 2], float64 x, tensors on
other devices) go to the reference inside :func:`rope_triton`, so the op's contract is the reference's.
"""

from __future__ import annotations

import math
import os

import torch

from dsinfer.ops.registry import register

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

ELEMENTS_PER_PROGRAM = 4096  # rows x padded channels one program moves: ~8 KiB of bf16 in, the same out
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rope_triton_available() -> bool:
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _rope_kernel(
        x_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        rows,  # N * M
        heads,  # M: rows per token (they share the token's angles)
        stride_xn,
        stride_xm,
        stride_xc,
        stride_cn,
        stride_cc,
        stride_sn,
        stride_sc,
        NOPE: tl.constexpr,  # channels copied unchanged
        HALF: tl.constexpr,  # rope_dim // 2 channel pairs
        BLOCK_R: tl.constexpr,
        BLOCK_NOPE: tl.constexpr,  # next power of two of NOPE (0 when there is none)
        BLOCK_HALF: tl.constexpr,  # next power of two of HALF
        INVERSE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        row = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        row_ok = row < rows
        token = row // heads
        head = row - token * heads
        x_row = x_ptr + token * stride_xn + head * stride_xm  # [BLOCK_R] pointers
        out_row = out_ptr + row * (NOPE + 2 * HALF)

        if BLOCK_NOPE > 0:
            c = tl.arange(0, BLOCK_NOPE)
            mask = row_ok[:, None] & (c < NOPE)[None, :]
            nope = tl.load(x_row[:, None] + c[None, :] * stride_xc, mask=mask)
            tl.store(out_row[:, None] + c[None, :], nope, mask=mask)

        # The rope slice as [rows, pairs, 2]: contiguous in memory, split into the even and odd channels.
        j = tl.arange(0, BLOCK_HALF)
        k = tl.arange(0, 2)
        channel = NOPE + 2 * j[None, :, None] + k[None, None, :]
        mask = row_ok[:, None, None] & (j < HALF)[None, :, None]
        pairs = tl.load(x_row[:, None, None] + channel * stride_xc, mask=mask, other=0.0).to(tl.float32)
        even, odd = tl.split(pairs)
        angle_mask = row_ok[:, None] & (j < HALF)[None, :]
        cos = tl.load(cos_ptr + token[:, None] * stride_cn + j[None, :] * stride_cc, mask=angle_mask, other=0.0)
        sin = tl.load(sin_ptr + token[:, None] * stride_sn + j[None, :] * stride_sc, mask=angle_mask, other=0.0)
        cos = cos.to(tl.float32)
        sin = sin.to(tl.float32)
        if INVERSE:
            sin = -sin
        rotated = tl.join(even * cos - odd * sin, even * sin + odd * cos)
        tl.store(out_row[:, None, None] + channel, rotated.to(out_ptr.dtype.element_ty), mask=mask)


def serves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel takes these inputs (else :func:`rope_triton` runs the reference)."""
    if x.dim() < 2 or x.dtype not in DTYPES or cos.dim() != 2 or cos.shape != sin.shape:
        return False
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        return False
    if not (x.device == cos.device == sin.device) or x.requires_grad:
        return False
    half = cos.shape[-1]
    return half > 0 and x.shape[-1] >= 2 * half and cos.shape[0] in (x.shape[0], 1)


def rope_launch(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, in_place: bool = False
) -> torch.Tensor:
    """The kernel on inputs :func:`serves` accepts: a new contiguous tensor shaped and typed like ``x``, or with
    ``in_place`` (``x`` contiguous) ``x`` itself with only its rope channels rewritten."""
    tokens, dim, half = x.shape[0], x.shape[-1], cos.shape[-1]
    heads = math.prod(x.shape[1:-1])
    out = x if in_place else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = tokens * heads
    if rows == 0 or dim == 0:
        return out
    x3 = x.reshape(tokens, heads, dim)  # a view where the strides allow it, else one copy
    cos, sin = cos.expand(tokens, half), sin.expand(tokens, half)  # one token's angles for all: stride 0
    nope = dim - 2 * half
    block_nope = triton.next_power_of_2(nope) if nope and not in_place else 0  # in place: the nope stays
    block_half = triton.next_power_of_2(half)
    width = max(block_nope, 2 * block_half)
    # at least eight programs where there are eight rows (a decode step's 64 query heads, in place, would
    # otherwise be one program)
    block_r = min(max(1, ELEMENTS_PER_PROGRAM // width), max(1, triton.next_power_of_2(rows) // 8))
    grid = (triton.cdiv(rows, block_r),)
    _rope_kernel[grid](
        x3,
        cos,
        sin,
        out,
        rows,
        heads,
        x3.stride(0),
        x3.stride(1),
        x3.stride(2),
        cos.stride(0),
        cos.stride(1),
        sin.stride(0),
        sin.stride(1),
        NOPE=nope,
        HALF=half,
        BLOCK_R=block_r,
        BLOCK_NOPE=block_nope,
        BLOCK_HALF=block_half,
        INVERSE=bool(inverse),
        num_warps=4,
        enable_fp_fusion=False,  # no fused multiply-add: the reference's roundings, bit for bit
    )
    return out


@register("rope", "triton", devices=("cuda",), available=rope_triton_available, priority=10)
def rope_triton(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, in_place: bool = False
) -> torch.Tensor:
    """Same contract and results as ``rope_reference``; inputs the kernel does not take (and in-place calls on a
    non-contiguous ``x``) go to the reference."""
    if not serves(x, cos, sin) or (in_place and not x.is_contiguous()):
        from dsinfer.ops.norm_rope.reference import rope_reference

        return rope_reference(x, cos, sin, inverse, in_place)
    return rope_launch(x, cos, sin, inverse, in_place)
