"""The routed-experts op ``routed_moe``: one MoE layer's routed experts over stacked, checkpoint-precision weights.

``routed_moe(x [T, H], weights: ExpertWeights, expert_ids [T, k] int64, expert_weights [T, k] float32,
swiglu_limit: float) -> [T, H]`` in ``x.dtype``. Backends: ``reference`` (torch, the truth, CPU and CUDA),
``triton`` (CUDA: fused grouped GEMMs, FP4 dequantised in the kernel, no host synchronisation) and
``grouped_mm`` (CUDA, dense bf16 experts only, opt-in). The weight layout is in :mod:`dsinfer.ops.moe.weights`.
"""

from dsinfer.ops.moe import grouped_mm, triton  # noqa: F401  (registers the backends)
from dsinfer.ops.moe.reference import routed_moe_reference
from dsinfer.ops.moe.routing import AlignedSlots, SortedSlots, align_slots, max_aligned_blocks, sort_slots
from dsinfer.ops.moe.weights import ExpertWeights, dequantize_expert, stack_experts

__all__ = [
    "AlignedSlots",
    "ExpertWeights",
    "SortedSlots",
    "align_slots",
    "dequantize_expert",
    "max_aligned_blocks",
    "routed_moe_reference",
    "sort_slots",
    "stack_experts",
]
