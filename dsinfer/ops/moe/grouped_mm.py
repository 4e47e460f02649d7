"""The routed-experts op on dense bf16 experts through torch's grouped GEMM (``torch._grouped_mm``).

Why it exists: for checkpoints whose experts are stored dense in bf16, torch's CUTLASS grouped GEMM may beat
our Triton kernel at prefill sizes; ``benchmarks/moe_kernel.py`` measures both. It is sync-free: the rows are
gathered into the aligned layout of :func:`dsinfer.ops.moe.routing.align_slots` (each expert's rows padded to
a multiple of 16, which keeps every group's start aligned for the GEMM) and the group ends are device offsets.

Why it is not chosen automatically (priority -1, below the reference): the registry picks a backend by device
and dtype, not by weight format, and this one cannot take FP4 experts; ``DSINFER_OPS=routed_moe=grouped_mm``
opts in for dense bf16 checkpoints, and FP4 weights are an error naming the alternative.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.ops.moe.reference import check_inputs
from dsinfer.ops.moe.routing import align_slots, sort_slots
from dsinfer.ops.moe.weights import ExpertWeights
from dsinfer.ops.registry import register

__all__ = ["grouped_mm_available", "routed_moe_grouped_mm"]

GROUP_ALIGNMENT = 16
"""Rows of each expert's group are padded to this multiple."""


def grouped_mm_available() -> bool:
    """Whether torch has the grouped GEMM and a CUDA device to run it on."""
    return hasattr(torch, "_grouped_mm") and torch.cuda.is_available()


@register(
    "routed_moe",
    "grouped_mm",
    devices=("cuda",),
    dtypes=(torch.bfloat16,),
    available=grouped_mm_available,
    priority=-1,
)
def routed_moe_grouped_mm(
    x: torch.Tensor,
    weights: ExpertWeights,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    swiglu_limit: float,
    slot_of_expert: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` in bf16, for dense bf16 expert weights (``slot_of_expert``: see the
    reference)."""
    if slot_of_expert is not None:
        expert_ids = slot_of_expert[expert_ids]
    check_inputs(x, weights, expert_ids, expert_weights)
    if weights.is_fp4 or weights.w13.dtype != torch.bfloat16 or x.dtype != torch.bfloat16:
        raise ValueError(
            "the grouped_mm routed_moe backend takes dense bf16 experts and bf16 activations "
            f"(got {'FP4' if weights.is_fp4 else weights.w13.dtype} experts, {x.dtype} x); use the triton backend"
        )
    tokens, top_k = expert_ids.shape
    num_slots = tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(x)
    aligned = align_slots(sort_slots(expert_ids, weights.num_experts), GROUP_ALIGNMENT)
    padded = aligned.slot_ids  # pad entries are num_slots
    # Row `tokens` of the extended input is zeros: padding rows gather it.
    x_ext = torch.cat([x, x.new_zeros(1, x.shape[1])])
    token_of_row = torch.where(padded < num_slots, padded // top_k, tokens)
    rows = x_ext.index_select(0, token_of_row)
    ends = (aligned.expert_block_ends * GROUP_ALIGNMENT).to(torch.int32)
    inter = weights.intermediate_size
    gate_up = torch._grouped_mm(rows, weights.w13.transpose(1, 2), offs=ends)
    gate = gate_up[:, :inter].clamp(max=swiglu_limit)
    up = gate_up[:, inter:].clamp(min=-swiglu_limit, max=swiglu_limit)
    down = torch._grouped_mm((F.silu(gate) * up).contiguous(), weights.w2.transpose(1, 2), offs=ends)
    route_ext = torch.cat([expert_weights.reshape(-1), expert_weights.new_zeros(1)])
    down = down * route_ext.index_select(0, padded)[:, None].to(down.dtype)
    # Rows past the last live group are not written by the GEMM; they all land in the dump row num_slots.
    out = x.new_zeros(num_slots + 1, x.shape[1])
    out.index_copy_(0, padded, down)
    return out[:num_slots].view(tokens, top_k, -1).sum(dim=1)
