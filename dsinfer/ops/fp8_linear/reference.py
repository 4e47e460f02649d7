"""The truth for FP8 linears: dequantise the block-scaled weight to the compute dtype, then ``F.linear``.

Exactly what a model whose FP8 weights were dequantised on load computes (e4m3 codes times power-of-two scales
are exact in float32, and both round the same float32 to the compute dtype), at the cost of one dequantisation
per call; a fused kernel reads the codes instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.ops.quant import dequantize_fp8_blockwise
from dsinfer.ops.registry import REFERENCE, register


@register("fp8_linear", REFERENCE)
def fp8_linear_reference(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``x @ dequant(codes, scale).T`` with the weight in ``dtype``; ``codes`` [out, in] e4m3, ``scale`` ue8m0."""
    return F.linear(x, dequantize_fp8_blockwise(codes, scale, block, dtype=dtype))
