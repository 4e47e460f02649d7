"""The router's pick in one Triton kernel: one program per token takes the k best experts by repeated arg-max
(equal values: the lowest expert, as the reference's packed-key top-k), gathers their scores, normalises and
scales them.

The reference spends about fifteen kernels per call (the packed keys' bit tricks, a top-k, a gather, a sum, a
division, a product); at a decode step of a few tokens each is a launch for almost no work. Expert counts of the
models (256 for V4, 384 for V4.1) fit one block; k is small (6), so k passes over the block in registers cost
nothing next to a launch. The weights' sum adds the k picks in pick order, which may differ from torch's in the
last float32 bit.
"""

from __future__ import annotations

import os

import torch

from dsinfer.ops.registry import register

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

MAX_EXPERTS = 4096


def triton_available() -> bool:
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _route_kernel(
        scores_ptr,
        bias_ptr,
        fixed_ptr,
        experts_ptr,
        weights_ptr,
        num_experts,
        stride_s,
        stride_b,  # 0: one bias row for every token
        stride_f,
        scaling,
        K: tl.constexpr,
        FIXED: tl.constexpr,
        NORMALIZE: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        e_ok = e < num_experts
        scores = tl.load(scores_ptr + t * stride_s + e, mask=e_ok, other=0.0)
        slot = tl.arange(0, BLOCK_K)
        picked = tl.zeros([BLOCK_K], tl.int64)
        weights = tl.zeros([BLOCK_K], tl.float32)
        if FIXED:
            picked = tl.load(fixed_ptr + t * stride_f + slot, mask=slot < K, other=0).to(tl.int64)
            for i in tl.static_range(K):
                expert = tl.sum(tl.where(slot == i, picked, 0))
                weights = tl.where(slot == i, tl.sum(tl.where(e == expert, scores, 0.0)), weights)
        else:
            bias = tl.load(bias_ptr + t * stride_b + e, mask=e_ok, other=0.0)
            keys = scores + bias
            free = e_ok  # experts not picked yet (a -inf key can still be picked, after every finite one)
            for i in tl.static_range(K):
                best = tl.max(tl.where(free, keys, float("-inf")), axis=0)
                expert = tl.min(tl.where(free & (keys == best), e, BLOCK_E), axis=0)
                picked = tl.where(slot == i, expert.to(tl.int64), picked)
                weights = tl.where(slot == i, tl.sum(tl.where(e == expert, scores, 0.0)), weights)
                free = free & (e != expert)
        if NORMALIZE:
            total = 0.0
            for i in tl.static_range(K):
                total += tl.sum(tl.where(slot == i, weights, 0.0))
            weights = weights / (total + 1e-20)
        tl.store(experts_ptr + t * K + slot, picked, mask=slot < K)
        tl.store(weights_ptr + t * K + slot, weights * scaling, mask=slot < K)


def serves(scores: torch.Tensor, bias: torch.Tensor | None, fixed_experts: torch.Tensor | None, k: int) -> bool:
    """Whether the kernel takes these inputs (else :func:`moe_route_triton` runs the reference)."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1 or scores.requires_grad:
        return False
    tokens, experts = scores.shape
    if not 0 < k <= experts or experts > MAX_EXPERTS:
        return False
    if fixed_experts is not None:
        return fixed_experts.shape == (tokens, k) and fixed_experts.stride(1) == 1
    if bias is None or bias.dtype != torch.float32 or bias.stride(-1) != 1:
        return False
    return bias.shape == (experts,) or bias.shape == (tokens, experts)


@register("moe_route", "triton", devices=("cuda",), available=triton_available, priority=10)
def moe_route_triton(
    scores: torch.Tensor,
    bias: torch.Tensor | None,
    fixed_experts: torch.Tensor | None,
    k: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``moe_route_reference``."""
    if not serves(scores, bias, fixed_experts, k):
        from dsinfer.ops.router.reference import moe_route_reference

        return moe_route_reference(scores, bias, fixed_experts, k, normalize, scaling)
    tokens, num_experts = scores.shape
    experts = torch.empty(tokens, k, dtype=torch.int64, device=scores.device)
    weights = torch.empty(tokens, k, dtype=torch.float32, device=scores.device)
    if tokens == 0:
        return experts, weights
    fixed = fixed_experts if fixed_experts is not None else experts
    bias_arg = bias if bias is not None else scores
    stride_b = bias.stride(0) if bias is not None and bias.dim() == 2 else 0
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(tokens,)](
        scores, bias_arg, fixed, experts, weights, num_experts, scores.stride(0), stride_b, fixed.stride(0),
        float(scaling), K=k, FIXED=fixed_experts is not None, NORMALIZE=bool(normalize), BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(k), num_warps=4 if block_e <= 512 else 8,
    )  # fmt: skip
    return experts, weights
