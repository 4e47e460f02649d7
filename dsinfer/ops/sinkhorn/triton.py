"""Sinkhorn-Knopp for mHC in one Triton kernel: every token's n x n matrix stays in registers for all iterations.

The torch reference launches three kernels per normalisation, 117 for the 20 iterations of one mHC site, twice
per layer: at decode sizes those launches, not the arithmetic, are the cost. Here one launch does them all.
Each program takes ``BLOCK_T`` tokens; the sums over four elements may round differently from torch's in the
last bit (tests/ops bind the result to the reference within float32 rounding).
"""

from __future__ import annotations

import torch

from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

BLOCK_T = 64


if triton is not None:

    @triton.jit
    def _sinkhorn_kernel(src, dst, tokens, eps, ITERATIONS: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        token = pid * BLOCK + tl.arange(0, BLOCK)
        rows = tl.arange(0, N)
        cols = tl.arange(0, N)
        offsets = token[:, None, None] * (N * N) + rows[None, :, None] * N + cols[None, None, :]
        mask = (token < tokens)[:, None, None]
        comb = tl.load(src + offsets, mask=mask, other=1.0)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
        for _ in tl.static_range(ITERATIONS - 1):  # the count is fixed per model: unrolled
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
        tl.store(dst + offsets, comb, mask=mask)


def _serves_shape(comb: torch.Tensor) -> bool:
    n = comb.shape[-1]
    return comb.dtype == torch.float32 and comb.shape[-2] == n and n >= 2 and n & (n - 1) == 0


@register("sinkhorn", "triton", devices=("cuda",), available=triton_available, priority=10)
def sinkhorn_triton(comb: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """Same contract as the reference; shapes the kernel does not serve (n not a power of two) go to it."""
    if not _serves_shape(comb) or iterations < 1:
        from dsinfer.ops.sinkhorn.reference import sinkhorn_reference

        return sinkhorn_reference(comb, iterations, eps)
    n = comb.shape[-1]
    flat = comb.contiguous().view(-1, n, n)
    out = torch.empty_like(flat)
    tokens = flat.shape[0]
    if tokens:
        grid = (triton.cdiv(tokens, BLOCK_T),)
        _sinkhorn_kernel[grid](flat, out, tokens, eps, ITERATIONS=iterations, N=n, BLOCK=BLOCK_T)
    return out.view(comb.shape)
