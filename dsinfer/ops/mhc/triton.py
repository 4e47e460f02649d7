"""mHC's stream collapse and expand, each one memory-bound Triton kernel.

The torch reference of the collapse materialises the [T, n, D] float32 product before summing it (1 GiB written
and read again at T=16384, n=4, D=4096), and the expand's batched n x n @ n x D matmul goes to a cuBLAS kernel
made for large matrices (milliseconds for what is a pass over memory). At decode sizes both are several small
launches. Here each program takes ``BLOCK_T`` tokens by ``BLOCK_D`` columns, loads the n stream rows once,
accumulates in float32 and rounds to the streams' dtype once.

The expand casts ``post`` and ``comb`` to the streams' dtype before multiplying, as the reference does, but
rounds the sum once where the reference rounds the spread, the matmul and their sum each: in bf16 a result may
differ from the reference's in its last bit (tests/ops/test_mhc.py states the bound).
"""

from __future__ import annotations

import math

import torch

from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

BLOCK_D = 512  # columns per program (fewer when D is smaller): contiguous 1-2 KiB rows per stream
COLLAPSE_BLOCK_T = 4  # tokens per program; the expand holds n output rows per token, so it takes fewer
EXPAND_BLOCK_T = 2
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


if triton is not None:

    @triton.jit
    def _collapse_kernel(src, pre, dst, tokens, D, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
        token = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # T * n * D may pass 2**31
        column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        token_ok = token < tokens
        mask = token_ok[:, None] & (column < D)[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK), dtype=tl.float32)
        for j in tl.static_range(N):
            weight = tl.load(pre + token * N + j, mask=token_ok, other=0.0)
            row = tl.load(src + (token * N + j)[:, None] * D + column[None, :], mask=mask, other=0.0)
            acc += weight[:, None] * row.to(tl.float32)
        tl.store(dst + token[:, None] * D + column[None, :], acc.to(dst.dtype.element_ty), mask=mask)

    @triton.jit
    def _expand_kernel(y, src, post, comb, dst, tokens, D, N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
        token = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        stream = tl.arange(0, N)
        token_ok = token < tokens
        mask = token_ok[:, None] & (column < D)[None, :]
        dtype = dst.dtype.element_ty
        # post and comb in the streams' dtype first, as the reference casts them
        spread = tl.load(post + token[:, None] * N + stream[None, :], mask=token_ok[:, None], other=0.0)
        spread = spread.to(dtype).to(tl.float32)
        block_output = tl.load(y + token[:, None] * D + column[None, :], mask=mask, other=0.0).to(tl.float32)
        acc = spread[:, :, None] * block_output[:, None, :]  # [BLOCK_T, N, BLOCK]
        for j in tl.static_range(N):
            # comb[t, j, i] for every output stream i: stream j's weight in each new stream
            weight = tl.load(
                comb + token[:, None] * (N * N) + j * N + stream[None, :], mask=token_ok[:, None], other=0.0
            )
            weight = weight.to(dtype).to(tl.float32)
            row = tl.load(src + (token * N + j)[:, None] * D + column[None, :], mask=mask, other=0.0)
            acc += weight[:, :, None] * row.to(tl.float32)[:, None, :]
        offsets = (token[:, None, None] * N + stream[None, :, None]) * D + column[None, None, :]
        tl.store(dst + offsets, acc.to(dtype), mask=mask[:, None, :])


def _serves(streams: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> bool:
    """What the kernels take: [..., n, D] streams of a float dtype, n a power of two up to 16, float weights."""
    if streams.dim() < 2 or streams.dtype not in DTYPES:
        return False
    n = streams.shape[-2]
    return 2 <= n <= 16 and n & (n - 1) == 0 and all(w.is_floating_point() for w in weights)


def _blocks(tokens: int, columns: int, block_t: int) -> tuple[int, int]:
    """Tokens and columns per program: the defaults, fewer where the input is smaller (one token at decode)."""
    return min(block_t, triton.next_power_of_2(max(tokens, 1))), min(BLOCK_D, triton.next_power_of_2(columns))


@register("hc_collapse", "triton", devices=("cuda",), available=triton_available, priority=10)
def hc_collapse_triton(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Same contract as the reference; what the kernel does not take (``pre`` not float32 or not [..., n], n not
    a power of two) goes to it."""
    if not _serves(streams, (pre,)) or pre.dtype != torch.float32 or pre.shape != streams.shape[:-1]:
        from dsinfer.ops.mhc.reference import hc_collapse_reference

        return hc_collapse_reference(streams, pre)
    n, width = streams.shape[-2:]
    tokens = math.prod(streams.shape[:-2])
    flat = streams.contiguous().view(tokens, n, width)
    weights = pre.contiguous().view(tokens, n)
    out = torch.empty(tokens, width, dtype=streams.dtype, device=streams.device)
    if tokens and width:
        block_t, block_d = _blocks(tokens, width, COLLAPSE_BLOCK_T)
        grid = (triton.cdiv(tokens, block_t), triton.cdiv(width, block_d))
        _collapse_kernel[grid](flat, weights, out, tokens, width, N=n, BLOCK_T=block_t, BLOCK=block_d)
    return out.view(*streams.shape[:-2], width)


@register("hc_expand", "triton", devices=("cuda",), available=triton_available, priority=10)
def hc_expand_triton(
    block_output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Same contract as the reference; what the kernel does not take (a block output of another dtype or shape,
    weights that only broadcast, n not a power of two) goes to it."""
    lead = streams.shape[:-1]
    if (
        not _serves(streams, (post, comb))
        or block_output.dtype != streams.dtype
        or block_output.shape != streams.shape[:-2] + streams.shape[-1:]
        or post.shape != lead
        or comb.shape != lead + streams.shape[-2:-1]
    ):
        from dsinfer.ops.mhc.reference import hc_expand_reference

        return hc_expand_reference(block_output, streams, post, comb)
    n, width = streams.shape[-2:]
    tokens = math.prod(streams.shape[:-2])
    flat = streams.contiguous().view(tokens, n, width)
    y = block_output.contiguous().view(tokens, width)
    spread, mix = post.contiguous().view(tokens, n), comb.contiguous().view(tokens, n, n)
    out = torch.empty_like(flat)
    if tokens and width:
        block_t, block_d = _blocks(tokens, width, EXPAND_BLOCK_T)
        grid = (triton.cdiv(tokens, block_t), triton.cdiv(width, block_d))
        _expand_kernel[grid](y, flat, spread, mix, out, tokens, width, N=n, BLOCK_T=block_t, BLOCK=block_d)
    return out.view(streams.shape)
