"""The truth for FP8 linears: dequantise the block-scaled weight to the compute dtype, then ``F.linear``.

Exactly what a model whose FP8 weights were dequantised on load computes (e4m3 codes times power-of-two scales
are exact in float32, and both round the same float32 to the compute dtype), at the cost of one dequantisation
per call; a fused kernel reads the codes instead.

``groups`` > 1 is a grouped projection (the attention's ``wo_a``): the weight's rows and the input's columns are
cut into ``groups`` equal runs, and each run of output columns is its own run of input columns times its own
rows of the weight.
"""

from __future__ import annotations

import torch

from dsinfer.ops.grouped_linear import grouped_linear
from dsinfer.ops.quant import dequantize_fp8_blockwise
from dsinfer.ops.registry import REFERENCE, register


def check_groups(x: torch.Tensor, codes: torch.Tensor, groups: int) -> None:
    """One clear error for a grouped call whose shapes do not cut into ``groups`` runs."""
    out_features, in_features = codes.shape
    if groups < 1 or out_features % groups:
        raise ValueError(f"fp8_linear: {out_features} weight rows do not split into {groups} groups")
    if x.shape[-1] != groups * in_features:
        raise ValueError(
            f"fp8_linear: input has {x.shape[-1]} columns, expected {groups} groups x {in_features} = "
            f"{groups * in_features}"
        )


@register("fp8_linear", REFERENCE)
def fp8_linear_reference(
    x: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    groups: int = 1,
) -> torch.Tensor:
    """``x @ dequant(codes, scale).T`` with the weight in ``dtype``; ``codes`` [out, in] e4m3, ``scale`` ue8m0.

    With ``groups`` > 1, ``x`` [..., groups * in] and the result [..., out]: group ``g``'s output columns are
    ``x[..., g*in:(g+1)*in] @ W[g*out/groups:(g+1)*out/groups].T``."""
    check_groups(x, codes, groups)
    return grouped_linear(x, dequantize_fp8_blockwise(codes, scale, block, dtype=dtype), groups)
