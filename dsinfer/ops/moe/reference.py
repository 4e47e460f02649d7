"""The routed-experts op's torch reference: the truth every faster backend is tested against.

It computes exactly what ``dsinfer.layers.moe.MoE._dispatch`` computes for the routed part, on the experts
dequantised to ``x.dtype`` (FP4 codes times power-of-two scales are exact in bf16 and fp32), so in fp32 on the
CPU its result is bit-identical to a ``ModuleList`` of ``Expert`` built from the same dequantised weights:
slots are sorted stably by expert, experts run in increasing id order, each expert's output is scaled by its
routing weight cast to ``x.dtype`` and ``index_add_``-ed into zeros, gate and up are two separate ``F.linear``
calls like ``w1`` and ``w3`` are two ``nn.Linear``.

Known cost, on purpose: the loop over experts needs each expert's count on the host (one ``.tolist()``, a
device synchronisation on CUDA), and each used expert is dequantised on every call. That keeps the truth
short and obviously right; it is the CPU path. On CUDA, the ``triton`` backend (and ``grouped_mm`` for dense
bf16 weights) is the sync-free path that a captured CUDA graph needs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.ops.moe.routing import sort_slots
from dsinfer.ops.moe.weights import ExpertWeights, dequantize_expert
from dsinfer.ops.registry import REFERENCE, register

__all__ = ["check_inputs", "routed_moe_reference"]


def check_inputs(x: torch.Tensor, weights: ExpertWeights, expert_ids: torch.Tensor, expert_weights: torch.Tensor):
    """Shape and dtype checks shared by every backend (host-side metadata only, never a device value)."""
    if x.dim() != 2 or x.shape[1] != weights.hidden_size:
        raise ValueError(f"x must be [T, {weights.hidden_size}], got {tuple(x.shape)}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != x.shape[0] or expert_ids.dtype != torch.int64:
        raise ValueError(
            f"expert_ids must be int64 [T={x.shape[0]}, k], got {expert_ids.dtype} {tuple(expert_ids.shape)}"
        )
    if expert_weights.shape != expert_ids.shape or expert_weights.dtype != torch.float32:
        raise ValueError(
            f"expert_weights must be float32 {tuple(expert_ids.shape)}, got {expert_weights.dtype} "
            f"{tuple(expert_weights.shape)}"
        )
    for name, tensor in (("expert_ids", expert_ids), ("expert_weights", expert_weights), ("weights", weights.w13)):
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device} but x is on {x.device}")


@register("routed_moe", REFERENCE)
def routed_moe_reference(
    x: torch.Tensor,
    weights: ExpertWeights,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    swiglu_limit: float,
    slot_of_expert: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_j expert_weights[t, j] * Expert_{expert_ids[t, j]}(x[t])`` for every token, ``[T, H]`` in ``x.dtype``.

    ``slot_of_expert`` (int64 ``[E]``): expert ``e``'s weights are ``weights``' entry ``slot_of_expert[e]`` (experts
    offloaded to host memory, :mod:`dsinfer.offload`); the experts still run in increasing id order, so where they
    sit never changes a bit of the result."""
    check_inputs(x, weights, expert_ids, expert_weights)
    routed = torch.zeros_like(x)
    top_k = expert_ids.shape[1]
    num_experts = weights.num_experts if slot_of_expert is None else slot_of_expert.numel()
    entry_of = range(num_experts) if slot_of_expert is None else slot_of_expert.tolist()
    grouped = sort_slots(expert_ids, num_experts)
    token_of_slot = grouped.slots // top_k
    flat_weights = expert_weights.reshape(-1)
    inter = weights.intermediate_size
    start = 0
    for expert, count in enumerate(grouped.counts.tolist()):
        if count == 0:
            continue
        slots = grouped.slots[start : start + count]
        tokens = token_of_slot[start : start + count]
        start += count
        w13, w2 = dequantize_expert(weights, entry_of[expert], x.dtype)
        rows = x[tokens]
        gate = F.linear(rows, w13[:inter]).clamp(max=swiglu_limit)
        up = F.linear(rows, w13[inter:]).clamp(min=-swiglu_limit, max=swiglu_limit)
        out = F.linear(F.silu(gate) * up, w2) * flat_weights[slots, None].to(x.dtype)
        routed.index_add_(0, tokens, out)
    return routed
