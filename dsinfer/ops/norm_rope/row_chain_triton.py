"""Row chains in one Triton kernel: a row's norm (none, weighted, or weightless), its RoPE and V4.1's rounding (or
none), each program loading whole rows once, running the chain in registers and storing each row once. It serves
``rms_normalize_rope`` (the query's weightless norm and RoPE, registered here), the ``rope`` op into a new tensor
(:mod:`~dsinfer.ops.norm_rope.rope_triton`: faster than the rope kernel's layout there at every shape measured on
the H200, docs/perf.md, pass 6) and ``rope_and_round`` (:mod:`dsinfer.ops.rope_round`).

A V4.1 decode step ran its rounding chains as 17 launches more than it needed (``kv_norm``, RoPE and the FP8
rounding of the window K=V in every layer; RoPE and the FP4 rounding of the compressed entries, index keys and
index queries): each a microsecond or two of a step whose cost is its launches. A prefill's [T, 64, 512] queries
were read and written by the norm, then their rope channels read and written again by the rotation.

Each stage rounds as its own kernel does, so the result is the unfused Triton kernels' bit for bit wherever those
agree with each other's reductions (in bf16 and fp16 on the H200):

* the weighted norm: the sum of squares in float32, ``weight * (x * scale)`` rounded once to x's dtype (as
  :mod:`~dsinfer.ops.norm_rope.rms_norm_triton`); the weightless norm: the scale rounded to x's dtype, the row
  multiplied by it and rounded (as the reference). The sum's order may differ from torch's, and in float32 from
  the norm kernel's, in the last bits, within the norm's tolerance of the reference;
* RoPE: the pairs of the normalised (rounded) rows rotated in float32 without fused multiply-adds, rounded to
  x's dtype (as :mod:`~dsinfer.ops.norm_rope.rope_triton`, bit-identical to the reference);
* the rounding: the helpers of :mod:`dsinfer.ops.fake_quant.triton` (bit-identical to the reference) on the
  rotated rows read back as float32, as the reference reads its bf16 input.

Rows are read at their strides (a column slice of a joined GEMM's output, or its [T, heads, head_dim] view, is
not copied); the result is a new contiguous tensor. Inputs the kernel does not take go to the references.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsinfer.ops.fake_quant.triton import KIND_FP4_E4M3, KIND_FP4_UE8M0, KIND_FP8
from dsinfer.ops.norm_rope.reference import rms_normalize_rope_reference
from dsinfer.ops.norm_rope.rms_norm_triton import MAX_ROW, norm_launch_shape, row_layout
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

if triton is not None:
    from dsinfer.ops.fake_quant.triton import (
        block_scale,
        e2m1_count,
        e2m1_magnitude,
        round_e4m3,
        scaled,
        with_sign_of,
    )

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KINDS = {None: -1, "fp8": KIND_FP8, "fp4_e4m3": KIND_FP4_E4M3, "fp4_ue8m0": KIND_FP4_UE8M0}
NO_NORM, WEIGHTED_NORM, WEIGHTLESS_NORM = 0, 1, 2


if triton is not None:

    @triton.jit
    def chain_rows(
        src,
        weight,
        cos_ptr,
        sin_ptr,
        rows,
        width,
        inner,
        stride_outer,
        stride_inner,
        stride_cn,
        stride_cc,
        stride_sn,
        stride_sc,
        eps,
        NOPE: tl.constexpr,
        NORM: tl.constexpr,
        KIND: tl.constexpr,
        QUANT_BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """This program's ``ROWS`` rows through the chain: ``(out, row, mask)``, ``out`` the result [ROWS, BLOCK] in
        float32 (before its cast to the rows' dtype), ``row`` the row numbers, ``mask`` the live elements."""
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = row < rows
        column = tl.arange(0, BLOCK)
        mask = row_ok[:, None] & (column < width)[None, :]
        token = (row // inner).to(tl.int64)
        start = token * stride_outer + (row % inner).to(tl.int64) * stride_inner
        x = tl.load(src + start[:, None] + column[None, :], mask=mask, other=0.0)
        y = x.to(tl.float32)
        if NORM == 1:  # the norm's output as its kernel stores it
            scale = 1.0 / tl.sqrt(tl.sum(y * y, axis=1) / width + eps)
            w = tl.load(weight + column, mask=column < width, other=0.0).to(tl.float32)
            y = (w[None, :] * (y * scale[:, None])).to(x.dtype).to(tl.float32)
        elif NORM == 2:  # the scale rounded to the rows' dtype, the product rounded (the reference's two roundings)
            scale = (1.0 / tl.sqrt(tl.sum(y * y, axis=1) / width + eps)).to(x.dtype).to(tl.float32)
            y = (y * scale[:, None]).to(x.dtype).to(tl.float32)

        # Channel pairs (2j, 2j + 1); pairs from NOPE // 2 on rotate by the token's angle j - NOPE // 2.
        even, odd = tl.split(tl.reshape(y, [ROWS, BLOCK // 2, 2]))
        pair = tl.arange(0, BLOCK // 2)
        rotates = (pair >= NOPE // 2) & (2 * pair < width)
        angle = tl.where(rotates, pair - NOPE // 2, 0)
        angle_mask = row_ok[:, None] & rotates[None, :]
        cos = tl.load(cos_ptr + token[:, None] * stride_cn + angle[None, :] * stride_cc, mask=angle_mask, other=1.0)
        sin = tl.load(sin_ptr + token[:, None] * stride_sn + angle[None, :] * stride_sc, mask=angle_mask, other=0.0)
        new_even = tl.where(rotates[None, :], even * cos - odd * sin, even)
        new_odd = tl.where(rotates[None, :], even * sin + odd * cos, odd)
        out = tl.reshape(tl.join(new_even, new_odd), [ROWS, BLOCK]).to(x.dtype).to(tl.float32)  # the rope's output

        if KIND >= 0:  # each row's blocks of QUANT_BLOCK channels through the format (the fake-quant kernel's math)
            blocks = tl.reshape(out, [ROWS * (BLOCK // QUANT_BLOCK), QUANT_BLOCK])
            block_max, inverse = block_scale(tl.max(tl.abs(blocks), axis=1), KIND)
            v = scaled(blocks, block_max[:, None], inverse[:, None], KIND)
            if KIND == 0:
                v = tl.minimum(tl.maximum(v, -448.0), 448.0)
                blocks = round_e4m3(v) * block_max[:, None]
            else:
                v = tl.minimum(tl.maximum(v, -6.0), 6.0)
                blocks = with_sign_of(e2m1_magnitude(e2m1_count(tl.abs(v))), v) * block_max[:, None]
            out = tl.reshape(blocks, [ROWS, BLOCK])
        return out, row, mask

    @triton.jit
    def _row_chain_kernel(
        src,
        weight,
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
        NORM: tl.constexpr,  # NO_NORM, WEIGHTED_NORM or WEIGHTLESS_NORM
        KIND: tl.constexpr,  # -1: no rounding, else the fake-quant kernel's kind
        QUANT_BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,  # next power of two of width
    ):
        out, row, mask = chain_rows(
            src, weight, cos_ptr, sin_ptr, rows, width, inner, stride_outer, stride_inner, stride_cn, stride_cc,
            stride_sn, stride_sc, eps, NOPE, NORM, KIND, QUANT_BLOCK, ROWS, BLOCK,
        )  # fmt: skip
        offsets = row.to(tl.int64)[:, None] * width + tl.arange(0, BLOCK)[None, :]
        tl.store(dst + offsets, out.to(dst.dtype.element_ty), mask=mask)


def serves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether a rotation kernel (this one or the ``rope`` kernel) takes these inputs, else its caller runs a
    reference: rows of a float dtype, float32 angles [N, rope_dim // 2] or [1, rope_dim // 2] on the same device,
    no autograd."""
    if x.dim() < 2 or x.dtype not in DTYPES or cos.dim() != 2 or cos.shape != sin.shape:
        return False
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        return False
    if not (x.device == cos.device == sin.device) or x.requires_grad:
        return False
    half = cos.shape[-1]
    return half > 0 and x.shape[-1] >= 2 * half and cos.shape[0] in (x.shape[0], 1)


def takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight=None, rounding=None, block: int = 0) -> bool:
    """Whether the kernel takes these inputs: rows of an even width up to MAX_ROW with an even nope part, angles
    the ``rope`` kernel would take, a float32-convertible weight of the row's width, and whole power-of-two
    rounding blocks."""
    width = x.shape[-1] if x.dim() else 0
    if not serves(x, cos, sin) or not 0 < width <= MAX_ROW or width % 2 or rounding not in KINDS:
        return False
    if weight is not None and (weight.shape != (width,) or weight.device != x.device or weight.requires_grad):
        return False
    if rounding is not None and (block <= 0 or block & (block - 1) or width % block):
        return False
    return True


class ChainRows(NamedTuple):
    """A row chain's rows and stages: ``x``'s rows rotated by ``cos`` / ``sin`` after the norm ``norm``
    (``NO_NORM``, ``WEIGHTED_NORM`` with ``weight``, or ``WEIGHTLESS_NORM``; ``eps``), then rounded as ``rounding``
    in ``block``-wide blocks (None: not rounded)."""

    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    weight: torch.Tensor | None
    eps: float
    norm: int
    rounding: str | None
    block: int


def launch_chain(kernel, chain: ChainRows, *outputs, rows_per_program: int | None = None, warps: int | None = None,
                 **constants) -> None:  # fmt: skip
    """``kernel`` (this module's or one built on :func:`chain_rows`) over ``chain``'s rows, inputs :func:`takes`
    accepts: the chain's arguments, then ``outputs`` (the kernel's arguments after ``sin_ptr``'s chain arguments:
    pointers and sizes) and its extra ``constants``; ``rows_per_program`` (a power of two) and ``warps`` override
    the norm kernels' choices."""
    x, rounding = chain.x, chain.rounding
    width, half = x.shape[-1], chain.cos.shape[-1]
    rows = x.numel() // width
    if rows == 0:
        return
    tokens = x.shape[0]
    rows3 = row_layout(x)  # [tokens, heads, width]: a token's rows share its angles
    cos, sin = chain.cos.expand(tokens, half), chain.sin.expand(tokens, half)  # one token's angles for all: stride 0
    row_block, per_program, norm_warps = norm_launch_shape(width)
    per_program, warps = rows_per_program or per_program, warps or norm_warps
    weight_arg = chain.weight.contiguous() if chain.weight is not None else cos  # never read without a weight
    kernel[(triton.cdiv(rows, per_program),)](
        rows3, weight_arg, cos, sin, *outputs, rows, width, rows3.shape[1], rows3.stride(0), rows3.stride(1),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), chain.eps,
        NOPE=width - 2 * half, NORM=chain.norm, KIND=KINDS[rounding],
        QUANT_BLOCK=chain.block if rounding is not None else 1, ROWS=per_program, BLOCK=row_block, num_warps=warps,
        **constants,
        enable_fp_fusion=False,  # no fused multiply-add: each stage's roundings, bit for bit
    )  # fmt: skip


def launch(chain: ChainRows) -> torch.Tensor:
    """The kernel over ``chain``'s rows (inputs :func:`takes` accepts): a new contiguous tensor shaped like ``x``."""
    out = torch.empty(chain.x.shape, dtype=chain.x.dtype, device=chain.x.device)
    launch_chain(_row_chain_kernel, chain, out)
    return out


@register("rms_normalize_rope", "triton", devices=("cuda",), available=triton_available, priority=10)
def rms_normalize_rope_triton(x: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`rms_normalize_rope_reference`; in bf16 / fp16 the unfused Triton kernels' results."""
    if not takes(x, cos, sin):
        return rms_normalize_rope_reference(x, eps, cos, sin)
    return launch(ChainRows(x, cos, sin, None, eps, WEIGHTLESS_NORM, None, 0))
