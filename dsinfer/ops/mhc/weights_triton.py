"""mHC's weights (``hc_weights``) in one Triton kernel: each token's ``pre``, ``post`` and Sinkhorn-projected ``comb``.

The reference turns a site's raw mixes [T, 2n + n*n] into its weights with about thirteen small torch kernels
(scale, bias and sigmoid for ``pre`` and ``post``; scale, bias, softmax and ``+ eps`` for ``comb``; then
Sinkhorn): at decode, where each moves a few hundred bytes, the launches are the cost, eight sites a step.
Here one program takes ``BLOCK_T`` tokens, keeps each token's n x n matrix in registers through the softmax and
every Sinkhorn iteration, and writes the three outputs.

Numerics: the same operations in the same order, in float32, compiled without fused multiply-adds (as the
reference rounds ``w * scale`` and ``+ bias`` separately). Triton's ``exp`` and the sums over n elements may
differ from torch's in the last bit, so the result equals the reference's within float32 rounding
(tests/ops/test_mhc_weights.py), not bit for bit.
"""

from __future__ import annotations

import torch

from dsinfer.ops.mhc.reference import streams_of_mixes
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

# Tokens per program and warps: one warp of 8 tokens keeps the n x n reductions of the twenty serial Sinkhorn rounds
# inside a warp. H200, one call, CUDA graph: 3.2 us at 1 token and 3.5 us at 4,096 against 8.8 and 9.4 us with 32
# tokens on 4 warps (the Sinkhorn's chain of dependent sums is the cost, not the bytes).
BLOCK_T = 8
NUM_WARPS = 1


if triton is not None:

    @triton.jit
    def _pre_weight(raw, base, scale, eps, N: tl.constexpr):
        """``pre`` from its raw mixes [B, N]: the sigmoid of the scaled and biased mixes, plus ``eps``. Shared with
        the fused site kernel (site_triton.py), whose collapse programs need ``pre`` alone."""
        return tl.sigmoid(raw * tl.load(scale) + tl.load(base + tl.arange(0, N))[None, :]) + eps

    @triton.jit
    def _post_comb_weights(post, logits, base, scale, eps, ITERATIONS: tl.constexpr, N: tl.constexpr):
        """``post`` [B, N] and ``comb`` [B, N, N] from their raw mixes: twice a sigmoid; a row softmax plus ``eps``,
        then Sinkhorn-Knopp, every iteration on the matrices in registers."""
        i = tl.arange(0, N)
        pair = i[:, None] * N + i[None, :]  # [N, N] offsets of the matrix
        post = 2.0 * tl.sigmoid(post * tl.load(scale + 1) + tl.load(base + N + i)[None, :])
        logits = logits * tl.load(scale + 2) + tl.load(base + 2 * N + pair)[None, :, :]
        shifted = logits - tl.max(logits, axis=2)[:, :, None]
        exps = tl.exp(shifted)
        comb = exps / tl.sum(exps, axis=2)[:, :, None] + eps
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
        for _ in tl.static_range(ITERATIONS - 1):  # the count is fixed per model: unrolled
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
        return post, comb

    @triton.jit
    def _weights_kernel(
        mixes,
        base,
        scale,
        pre_out,
        post_out,
        comb_out,
        tokens,
        eps,
        ITERATIONS: tl.constexpr,
        N: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        M: tl.constexpr = 2 * N + N * N
        token = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        ok = token < tokens
        i = tl.arange(0, N)
        row = token[:, None] * M + i[None, :]
        pair = i[:, None] * N + i[None, :]  # [N, N] offsets of the matrix
        pre = _pre_weight(tl.load(mixes + row, mask=ok[:, None], other=0.0), base, scale, eps, N)
        post, comb = _post_comb_weights(
            tl.load(mixes + row + N, mask=ok[:, None], other=0.0),
            tl.load(mixes + token[:, None, None] * M + 2 * N + pair[None, :, :], mask=ok[:, None, None], other=0.0),
            base, scale, eps, ITERATIONS, N,
        )  # fmt: skip
        out_row = token[:, None] * N + i[None, :]
        tl.store(pre_out + out_row, pre, mask=ok[:, None])
        tl.store(post_out + out_row, post, mask=ok[:, None])
        tl.store(comb_out + token[:, None, None] * (N * N) + pair[None, :, :], comb, mask=ok[:, None, None])


def _serves(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iterations: int) -> bool:
    """float32 mixes of a power-of-two ``n`` >= 2, a matching ``base`` and at least three ``scale`` entries."""
    if mixes.dtype != torch.float32 or mixes.dim() < 1 or iterations < 1:
        return False
    try:
        n = streams_of_mixes(mixes.shape[-1])
    except ValueError:
        return False
    return n >= 2 and n & (n - 1) == 0 and base.numel() == mixes.shape[-1] and scale.numel() >= 3


@register("hc_weights", "triton", devices=("cuda",), available=triton_available, priority=10)
def hc_weights_triton(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iterations: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as the reference; what the kernel does not take goes to it."""
    if not _serves(mixes, base, scale, iterations):
        from dsinfer.ops.mhc.reference import hc_weights_reference

        return hc_weights_reference(mixes, base, scale, iterations, hc_eps)
    n = streams_of_mixes(mixes.shape[-1])
    lead = mixes.shape[:-1]
    flat = mixes.contiguous().view(-1, mixes.shape[-1])
    tokens = flat.shape[0]
    pre = torch.empty(tokens, n, dtype=torch.float32, device=mixes.device)
    post = torch.empty(tokens, n, dtype=torch.float32, device=mixes.device)
    comb = torch.empty(tokens, n, n, dtype=torch.float32, device=mixes.device)
    if tokens:
        _weights_kernel[(triton.cdiv(tokens, BLOCK_T),)](
            flat, base.float().contiguous(), scale.float().contiguous(), pre, post, comb, tokens, float(hc_eps),
            ITERATIONS=iterations, N=n, BLOCK=BLOCK_T, enable_fp_fusion=False, num_warps=NUM_WARPS,
        )  # fmt: skip
    return pre.view(*lead, n), post.view(*lead, n), comb.view(*lead, n, n)
