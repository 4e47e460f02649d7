"""The routed-experts op ``routed_moe``: one MoE layer's routed experts over stacked, checkpoint-precision weights.

``routed_moe(x [T, H], weights: ExpertWeights, expert_ids [T, k] int64, expert_weights [T, k] float32,
swiglu_limit: float) -> [T, H]`` in ``x.dtype``. Backends: ``reference`` (torch, the truth, CPU and CUDA),
``triton`` (CUDA: fused grouped GEMMs, FP4 dequantised in the kernel, no host synchronisation) and
``grouped_mm`` (CUDA, dense bf16 experts only, opt-in). The weight layout is in :mod:`dsinfer.ops.moe.weights`.

Inside the ``triton`` backend, decode steps of at most ``DECODE_GEMV_MAX_TOKENS`` tokens (default 8) over packed
FP4 experts take a GEMV path instead (:mod:`dsinfer.ops.moe.decode_triton`): one kernel for gate/up and the
clamped SwiGLU per (slot, column tile), one for down, the routing weights and the combine per (token, column
tile), the e2m1 codes decoded in registers and multiplied on the CUDA cores; the expert ids are read on the
device, so the path is CUDA-graph safe like the grouped one.
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
