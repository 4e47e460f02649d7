"""The ``rope`` op in one Triton kernel: the nope channels copied and the rope channels rotated in one pass.

The torch reference slices, casts, multiplies, stacks, flattens and concatenates: about ten kernels per call,
and the concatenation copies every query and key once more. In a prefill the queries are [T, 64 heads, 512]
bf16 with a 64-channel rope slice, so that traffic, not the arithmetic, is the cost. Here each program takes
one token's angles once and a block of that token's rows (heads): it writes the nope channels unchanged and the
rope channels rotated, read as one contiguous tile plus each channel's pair partner (no split of the pairs).

Bit-identical to the reference: the pairs are rotated in float32 as ``even * cos - odd * sin`` and
``even * sin + odd * cos`` (``sin`` negated for ``inverse``, which is exact), each product and sum rounded to
float32 as torch does, then rounded once to ``x``'s dtype. The kernel is compiled with ``enable_fp_fusion=False``:
with fusion the compiler contracts ``a * b - c * d`` into a fused multiply-add, which skips one rounding and can
change the last float32 bit (and, rarely, the bf16 result). The unfused multiplies cost nothing measurable next
to the loads (on the H200 the in-place [4096, 64, 512] call takes 75.6 us: docs/perf.md, pass 5,
``benchmarks/norm_rope_kernels.py``).

With ``in_place`` (an x the caller owns, viewable as [N, M, dim]: contiguous, or a column slice of a wider
GEMM output) the kernel rewrites only the rope channels of x: a prefill's [T, 64, 512] queries are then read and
written at 64 of their 512 channels instead of copied whole.

Rows are x's middle axes flattened: [N, ..., dim] is viewed as [N, M, dim] (a view where the strides allow,
else one copy, out of place only), and the angles of token ``n`` are shared by its M rows. The grid is
(tokens, blocks of heads): no division per row, no angle loads per row. Inputs the kernel does not take (an
x of rank < 2, angles that are not float32 [N, rope_dim // 2] or [1, rope_dim // 2], float64 x, tensors on
other devices) go to the reference inside :func:`rope_triton`, so the op's contract is the reference's.
"""

from __future__ import annotations

import math

import torch

from dsinfer.ops.dependent_launch import dependent_launch
from dsinfer.ops.norm_rope.row_chain_triton import NO_NORM, ChainRows, serves
from dsinfer.ops.norm_rope.row_chain_triton import launch as row_chain_launch
from dsinfer.ops.norm_rope.row_chain_triton import takes as row_chain_takes
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

if triton is not None:
    from dsinfer.ops.dependent_launch import allow_dependents

ROPE_ELEMENTS_PER_PROGRAM = 2048  # rope channels one program rotates at most (BLOCK_H heads x BLOCK_ROPE)
NOPE_CHUNK = 128  # nope channels one program copies per step (out of place)
TARGET_PROGRAMS = 1024  # fewer heads a program until a launch has about this many programs (decode steps)


if triton is not None:

    @triton.jit
    def _rope_kernel(
        x_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        heads,  # M: rows per token (they share the token's angles)
        stride_xn,
        stride_xm,
        stride_xc,
        stride_on,
        stride_om,
        stride_oc,
        stride_cn,
        stride_cc,
        stride_sn,
        stride_sc,
        NOPE: tl.constexpr,  # channels copied unchanged (out of place) or left alone (in place)
        HALF: tl.constexpr,  # rope_dim // 2 channel pairs
        BLOCK_H: tl.constexpr,  # heads of one token per program
        BLOCK_NOPE: tl.constexpr,  # NOPE rounded up to a multiple of CHUNK (0: nothing to copy)
        CHUNK: tl.constexpr,  # nope channels copied per step
        BLOCK_ROPE: tl.constexpr,  # next power of two of 2 * HALF
        INVERSE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        allow_dependents(PDL)
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = head < heads
        x_row = x_ptr + token * stride_xn + head.to(tl.int64) * stride_xm  # [BLOCK_H] pointers
        out_row = out_ptr + token * stride_on + head.to(tl.int64) * stride_om

        for start in tl.static_range(0, BLOCK_NOPE, CHUNK):
            c = start + tl.arange(0, CHUNK)
            mask = head_ok[:, None] & (c < NOPE)[None, :]
            nope = tl.load(x_row[:, None] + c[None, :] * stride_xc, mask=mask)
            tl.store(out_row[:, None] + c[None, :] * stride_oc, nope, mask=mask)

        # The rope channels of each row as one contiguous tile, and each channel's pair partner (channel ^ 1) as a
        # second load of the same lines: even channels become x * cos - partner * sin, odd ones
        # partner * sin + x * cos (the reference's even * sin + odd * cos, the same float32 sum).
        c = tl.arange(0, BLOCK_ROPE)
        rope_ok = c < 2 * HALF
        pair = c // 2
        cos = tl.load(cos_ptr + token * stride_cn + pair * stride_cc, mask=rope_ok, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + token * stride_sn + pair * stride_sc, mask=rope_ok, other=0.0).to(tl.float32)
        if INVERSE:
            sin = -sin
        mask = head_ok[:, None] & rope_ok[None, :]
        channel = (NOPE + c)[None, :]
        x = tl.load(x_row[:, None] + channel * stride_xc, mask=mask, other=0.0).to(tl.float32)
        partner = tl.load(x_row[:, None] + (NOPE + (c ^ 1))[None, :] * stride_xc, mask=mask, other=0.0)
        x_cos = x * cos[None, :]
        partner_sin = partner.to(tl.float32) * sin[None, :]
        rotated = tl.where((c % 2 == 0)[None, :], x_cos - partner_sin, partner_sin + x_cos)
        tl.store(out_row[:, None] + channel * stride_oc, rotated.to(out_ptr.dtype.element_ty), mask=mask)


def token_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` [N, ..., dim] as a [N, M, dim] view of its own storage, or None where the strides allow no view."""
    try:
        return x.view(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])
    except RuntimeError:
        return None


def launch_shape(tokens: int, heads: int, half: int) -> tuple[int, int, int]:
    """(heads a program, block of rope channels, warps): up to ROPE_ELEMENTS_PER_PROGRAM rope channels a program, fewer
    heads a program where the launch would otherwise have under TARGET_PROGRAMS programs (a decode step's 64
    query heads are then 64 programs of one head, not one program)."""
    block_rope = triton.next_power_of_2(2 * half)
    cap = max(1, ROPE_ELEMENTS_PER_PROGRAM // block_rope)
    wanted = triton.next_power_of_2(max(1, -(-tokens * heads // TARGET_PROGRAMS)))
    block_h = max(1, min(cap, wanted, triton.next_power_of_2(heads)))
    warps = max(1, min(4, block_h * block_rope // 256))
    return block_h, block_rope, warps


def rope_launch(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, in_place: bool = False
) -> torch.Tensor:
    """The kernel on inputs :func:`serves` accepts: a new contiguous tensor shaped and typed like ``x``, or with
    ``in_place`` (``x`` viewable as [N, M, dim], see :func:`token_rows`) ``x`` itself with only its rope
    channels rewritten."""
    tokens, dim, half = x.shape[0], x.shape[-1], cos.shape[-1]
    heads = math.prod(x.shape[1:-1])
    out = x if in_place else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if tokens * heads == 0 or dim == 0:
        return out
    x3 = token_rows(x)
    if x3 is None:  # only out of place (rope_triton sends in-place calls on such x to the reference)
        x3 = x.reshape(tokens, heads, dim)
    out3 = x3 if in_place else out.view(tokens, heads, dim)
    cos, sin = cos.expand(tokens, half), sin.expand(tokens, half)  # one token's angles for all: stride 0
    nope = dim - 2 * half
    chunk = min(NOPE_CHUNK, triton.next_power_of_2(max(nope, 1)))
    block_nope = 0 if in_place or nope == 0 else triton.cdiv(nope, chunk) * chunk  # in place: the nope stays
    block_h, block_rope, warps = launch_shape(tokens, heads, half)
    grid = (tokens, triton.cdiv(heads, block_h))
    _rope_kernel[grid](
        x3,
        cos,
        sin,
        out3,
        heads,
        *x3.stride(),
        *out3.stride(),
        *cos.stride(),
        *sin.stride(),
        NOPE=nope,
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_NOPE=block_nope,
        CHUNK=chunk,
        BLOCK_ROPE=block_rope,
        INVERSE=bool(inverse),
        PDL=dependent_launch(x.device),
        num_warps=warps,
        enable_fp_fusion=False,  # no fused multiply-add: the reference's roundings, bit for bit
    )
    return out


@register("rope", "triton", devices=("cuda",), available=triton_available, priority=10)
def rope_triton(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, in_place: bool = False
) -> torch.Tensor:
    """Same contract and results as ``rope_reference``; inputs the kernel does not take (and in-place calls on an
    ``x`` that is no [N, M, dim] view) go to the reference.

    A forward rotation into a new tensor goes to the row-chain kernel where it takes the rows (whole rows a
    program: faster than this kernel out of place at every shape measured on the H200, the same values); in place
    this kernel touches only the rope channels."""
    if not serves(x, cos, sin) or (in_place and token_rows(x) is None):
        from dsinfer.ops.norm_rope.reference import rope_reference

        return rope_reference(x, cos, sin, inverse, in_place)
    if not (in_place or inverse) and row_chain_takes(x, cos, sin):
        return row_chain_launch(ChainRows(x, cos, sin, None, 0.0, NO_NORM, None, 0))
    return rope_launch(x, cos, sin, inverse, in_place)
