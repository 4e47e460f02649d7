"""mHC's weight inputs (``hc_mixes``) in one pass over the streams: RMS statistics and projection together.

The reference writes a float32 copy of the flattened streams (1 GiB at T=16384, n=4, D=4096), runs the square,
mean, rsqrt and multiply passes over it, then a float32 GEMM with only M = 2n + n*n (or n) outputs, for which
cuBLAS picks a slow SIMT kernel: about 3 ms per site in a prefill, and some six launches per site at decode.
Since ``rms_normalize(x) @ fn^T = (x @ fn^T) * rsqrt(mean(x^2) + eps)``, one pass over the unnormalised
streams can accumulate both the dot products and the sum of squares, and scale at the end.

Each program takes ``BLOCK_T`` tokens and a range of the n*D columns, loads each stream chunk once, accumulates
the sum of squares and the [BLOCK_T, M] products in float32 (M is padded to a power of two of at least 16,
``tl.dot``'s smallest). The products must be float32-accurate, never TF32:

* bf16 streams (the models' own dtype) are exact in bf16, so each float32 ``fn`` chunk is split in registers into
  three bf16 parts, ``hi + mid + lo``, that sum to it exactly (8 + 8 + 8 significant bits), and three bf16 tensor
  core dots accumulate in float32. Every product is exact, so only the float32 accumulation rounds, as in a
  float32 GEMM. IEEE float32 ``tl.dot`` runs on the CUDA cores and was 4x slower than cuBLAS's SIMT GEMM at
  T=16384 on the H200.
* float32 and float16 streams (tests, float32 checkpoints) use ``tl.dot`` with IEEE float32 inputs.

Prefill has enough token blocks to fill the GPU; decode and small batches would leave a few programs looping over
all n*D columns, so the columns are split over programs that write partial sums, and a second small kernel (one
program per token) adds them with a fixed-shape reduction and scales (deterministic, no atomics).

The result differs from the reference's by float32 rounding only: the reference rounds the normalised streams
before the GEMM and both sum in their own orders (tests/ops/test_mhc_mixes.py states the bound).
"""

from __future__ import annotations

import math

import torch

from dsinfer.ops.mhc.triton import DTYPES
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

BLOCK_T = 64  # tokens per program in a prefill: each program reads all of fn once, so more tokens share it
BLOCK_T_SPLIT_WEIGHTS = 128  # the same for the bf16 tensor-core path
MIN_BLOCK = 16  # tl.dot's smallest tile side: the token block and padded M never go below it
BLOCK_K = 64  # columns per loop step
MAX_M = 64  # widest projection served (V4: 24 for the block sites, 4 for the head)
TARGET_PROGRAMS = 256  # about two per SM on an H200: the column split stops once the grid has this many
MIN_SPLIT_COLUMNS = 256  # a split program takes at least this many columns (fewer would cost more in partials)


if triton is not None:

    @triton.jit
    def _mixes_kernel(
        src,
        fn,
        dst,
        partial_dots,
        partial_squares,
        tokens,
        columns,
        columns_per_split,
        eps,
        M: tl.constexpr,
        SPLIT: tl.constexpr,
        SPLIT_WEIGHTS: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        token = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # T * n * D may pass 2**31
        split = tl.program_id(1)
        row = tl.arange(0, BLOCK_M)
        token_ok = token < tokens
        row_ok = row < M
        start = split * columns_per_split
        end = tl.minimum(start + columns_per_split, columns)
        dots = tl.zeros((BLOCK_T, BLOCK_M), dtype=tl.float32)
        squares = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for k in range(start, end, BLOCK_K):
            column = k + tl.arange(0, BLOCK_K)
            column_ok = column < end
            x = tl.load(
                src + token[:, None] * columns + column[None, :],
                mask=token_ok[:, None] & column_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                fn + row[:, None] * columns + column[None, :], mask=row_ok[:, None] & column_ok[None, :], other=0.0
            ).to(tl.float32)
            wide = x.to(tl.float32)
            squares += tl.sum(wide * wide, axis=1)
            if SPLIT_WEIGHTS:
                w_hi = w.to(tl.bfloat16)
                rest = w - w_hi.to(tl.float32)
                w_mid = rest.to(tl.bfloat16)
                w_lo = (rest - w_mid.to(tl.float32)).to(tl.bfloat16)
                dots = tl.dot(x, tl.trans(w_lo), dots)
                dots = tl.dot(x, tl.trans(w_mid), dots)
                dots = tl.dot(x, tl.trans(w_hi), dots)
            else:
                dots = tl.dot(wide, tl.trans(w), dots, input_precision="ieee")
        if SPLIT == 1:
            scale = 1.0 / tl.sqrt_rn(squares / columns + eps)
            out = dots * scale[:, None]
            tl.store(dst + token[:, None] * M + row[None, :], out, mask=token_ok[:, None] & row_ok[None, :])
        else:
            base = split.to(tl.int64) * tokens + token
            tl.store(partial_dots + base[:, None] * BLOCK_M + row[None, :], dots, mask=token_ok[:, None])
            tl.store(partial_squares + base, squares, mask=token_ok)

    @triton.jit
    def _finish_kernel(
        partial_dots,
        partial_squares,
        dst,
        tokens,
        columns,
        eps,
        M: tl.constexpr,
        SPLIT: tl.constexpr,
        SPLIT_P2: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """One token's result: its SPLIT partial sums added by one fixed-shape reduction, then scaled."""
        token = tl.program_id(0).to(tl.int64)
        split = tl.arange(0, SPLIT_P2)
        split_ok = split < SPLIT
        row = tl.arange(0, BLOCK_M)
        base = split.to(tl.int64) * tokens + token
        dots = tl.load(partial_dots + base[:, None] * BLOCK_M + row[None, :], mask=split_ok[:, None], other=0.0)
        squares = tl.load(partial_squares + base, mask=split_ok, other=0.0)
        scale = 1.0 / tl.sqrt_rn(tl.sum(squares, axis=0) / columns + eps)
        out = tl.sum(dots, axis=0) * scale
        tl.store(dst + token * M + row, out, mask=row < M)


def _serves(streams: torch.Tensor, fn: torch.Tensor) -> bool:
    """What the kernel takes: [..., n, D] streams and an [M, n * D] ``fn`` of float dtypes, M up to MAX_M."""
    if streams.dim() < 2 or streams.dtype not in DTYPES or fn.dtype not in DTYPES or fn.dim() != 2:
        return False
    columns = streams.shape[-2] * streams.shape[-1]
    return columns > 0 and fn.shape[1] == columns and 1 <= fn.shape[0] <= MAX_M


def _plan(tokens: int, columns: int, split_weights: bool) -> tuple[int, int, int]:
    """Tokens per program, column splits and columns per split: one split while the token blocks fill the GPU,
    else as many as bring the grid to about TARGET_PROGRAMS with at least MIN_SPLIT_COLUMNS columns each."""
    widest = BLOCK_T_SPLIT_WEIGHTS if split_weights else BLOCK_T
    block_t = max(MIN_BLOCK, min(widest, triton.next_power_of_2(tokens)))
    token_blocks = triton.cdiv(tokens, block_t)
    split = max(1, min(TARGET_PROGRAMS // token_blocks, triton.cdiv(columns, MIN_SPLIT_COLUMNS)))
    per_split = triton.cdiv(triton.cdiv(columns, split), BLOCK_K) * BLOCK_K  # whole loop steps per program
    return block_t, triton.cdiv(columns, per_split), per_split


def plan_for(streams: torch.Tensor, fn: torch.Tensor) -> tuple[int, int, int]:
    """:func:`_plan` for these streams (at least one token) and ``fn``: tokens per program, splits and columns
    per split."""
    tokens = math.prod(streams.shape[:-2])
    return _plan(tokens, fn.shape[1], streams.dtype == torch.bfloat16)


def mixes_block(m: int) -> int:
    """The width of a token's row of partial dots: ``m`` mixes rounded up to a power of two, at least MIN_BLOCK."""
    return max(MIN_BLOCK, triton.next_power_of_2(m))


def launch_mixes(
    flat: torch.Tensor, weights: torch.Tensor, out: torch.Tensor | None, norm_eps: float, plan: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Run ``_mixes_kernel`` over the flattened streams [T, n*D] (T >= 1) with ``plan``: with one split it writes
    the scaled mixes into ``out`` and returns None; with more it returns the partial dots [split, T, BLOCK_M] and
    squares [split, T] for a second kernel to add (``_finish_kernel`` here, the fused site kernel in site_triton.py)
    and ``out`` may be None."""
    tokens, columns = flat.shape
    m = weights.shape[0]
    block_t, split, per_split = plan
    block_m = mixes_block(m)
    if split > 1:
        dots = torch.empty(split, tokens, block_m, dtype=torch.float32, device=flat.device)
        squares = torch.empty(split, tokens, dtype=torch.float32, device=flat.device)
    else:
        dots = squares = out  # not read: the kernel scales and stores the result itself
    _mixes_kernel[(triton.cdiv(tokens, block_t), split)](
        flat, weights, dots if out is None else out, dots, squares, tokens, columns, per_split, float(norm_eps),
        M=m, SPLIT=split, SPLIT_WEIGHTS=flat.dtype == torch.bfloat16, BLOCK_T=block_t, BLOCK_M=block_m, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return (dots, squares) if split > 1 else None


@register("hc_mixes", "triton", devices=("cuda",), available=triton_available, priority=10)
def hc_mixes_triton(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """Same contract as the reference; what the kernel does not take (an ``fn`` that does not match the
    flattened streams, more than MAX_M outputs, an empty stream width) goes to it."""
    if not _serves(streams, fn):
        from dsinfer.ops.mhc.reference import hc_mixes_reference

        return hc_mixes_reference(streams, fn, norm_eps)
    columns, m = fn.shape[1], fn.shape[0]
    tokens = math.prod(streams.shape[:-2])
    flat = streams.contiguous().view(tokens, columns)
    out = torch.empty(tokens, m, dtype=torch.float32, device=streams.device)
    if tokens:
        plan = plan_for(streams, fn)  # bf16 streams are exact in bf16: the tensor-core path
        partials = launch_mixes(flat, fn.contiguous(), out, norm_eps, plan)
        if partials is not None:
            dots, squares = partials
            split = plan[1]
            _finish_kernel[(tokens,)](
                dots, squares, out, tokens, columns, float(norm_eps), M=m, SPLIT=split,
                SPLIT_P2=triton.next_power_of_2(split), BLOCK_M=dots.shape[-1],
            )  # fmt: skip
    return out.view(*streams.shape[:-2], m)
