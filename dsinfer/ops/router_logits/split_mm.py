"""``router_logits`` on tensor cores: bf16 hidden states are exact in bf16, and the float32 weight is the exact sum
of three bf16 parts, so one bf16 GEMM against the stacked parts with float32 output (``torch.mm(..., out_dtype)``)
forms every product exactly; only the float32 sums round, in another order than the float32 GEMM's.

The reference's float32 GEMM runs on the CUDA cores: at a 4,096-token prefill it is a [4096 x 4096] by
[4096 x 256] FFMA GEMM per layer (~0.18 ms on an H200, plus the float32 copy of the hidden states), against
~0.02 ms for the three bf16 parts' GEMM.
"""

from __future__ import annotations

import torch

from dsinfer.ops.registry import register
from dsinfer.ops.router_logits.reference import router_logits_reference


def out_dtype_mm_available() -> bool:
    """Whether this torch runs a bf16 GEMM with float32 output on CUDA (``aten::mm.dtype``)."""
    if not torch.cuda.is_available():
        return False
    try:
        a = torch.ones(2, 16, dtype=torch.bfloat16, device="cuda")
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError):
        return False


@register("router_logits", "bf16_parts", devices=("cuda",), available=out_dtype_mm_available, priority=10)
def router_logits_split(x: torch.Tensor, weight: torch.Tensor, weight_parts: torch.Tensor | None) -> torch.Tensor:
    """Same contract as ``router_logits_reference``; float32 inputs or no parts go to the reference."""
    if weight_parts is None or x.dtype != torch.bfloat16 or x.dim() != 2:
        return router_logits_reference(x, weight, weight_parts)
    experts = weight.shape[0]
    count = weight_parts.shape[0] // experts
    parts = torch.mm(x, weight_parts.t(), out_dtype=torch.float32).view(x.shape[0], count, experts)
    logits = parts[:, 0]
    for index in range(1, count):
        logits = logits + parts[:, index]
    return logits
