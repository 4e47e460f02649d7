"""``rope_and_round`` on CUDA: the row-chain kernel of :mod:`dsinfer.ops.norm_rope.row_chain_triton` with the
weighted norm (or none) and V4.1's rounding (or none), one launch per chain; how each stage rounds, and why the
result is the unfused kernels' bit for bit, is told there."""

from __future__ import annotations

import torch

from dsinfer.ops.norm_rope.rope_triton import rope_triton
from dsinfer.ops.norm_rope.row_chain_triton import NO_NORM, WEIGHTED_NORM, ChainRows, launch, takes
from dsinfer.ops.registry import register
from dsinfer.ops.rope_round.reference import rope_and_round_reference
from dsinfer.ops.triton_support import triton_available


@register("rope_and_round", "triton", devices=("cuda",), available=triton_available, priority=10)
def rope_and_round_triton(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 0.0,
    rounding: str | None = None,
    block: int = 0,
) -> torch.Tensor:
    """Same contract as :func:`rope_and_round_reference`; inputs the kernel does not take go to it (a bare RoPE to
    the ``rope`` op's backend)."""
    if not takes(x, cos, sin, weight, rounding, block):
        if weight is None and rounding is None:
            return rope_triton(x, cos, sin)
        return rope_and_round_reference(x, cos, sin, weight, eps, rounding, block)
    return launch(ChainRows(x, cos, sin, weight, eps, NO_NORM if weight is None else WEIGHTED_NORM, rounding, block))
