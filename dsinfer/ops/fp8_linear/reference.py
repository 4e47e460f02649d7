"""The truth for FP8 linears: dequantise the block-scaled weight to the compute dtype, then ``F.linear``.

Exactly what a model whose FP8 weights were dequantised on load computes (e4m3 codes times power-of-two scales
are exact in float32, and both round the same float32 to the compute dtype), at the cost of one dequantisation
per call; a fused kernel reads the codes instead.

``groups`` > 1 is a grouped projection (the attention's ``wo_a``): the weight's rows and the input's columns are
cut into ``groups`` equal runs, and each run of output columns is its own run of input columns times its own
rows of the weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.grouped_linear import grouped_linear
from dsinfer.ops.quant import dequantize_fp8_blockwise
from dsinfer.ops.registry import REFERENCE, register


@dataclass(frozen=True)
class Fp8Weight:
    """A block-scaled FP8 weight as the checkpoint stores it: ``codes`` [out, in] e4m3 and one ``scale`` (ue8m0, or
    float32) for each ``block`` (rows, columns) of codes. The reference and every backend take the weight as one
    argument, so a caller cannot pass a scale with another weight's block."""

    codes: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [out, in] in ``dtype`` (exact products, one rounding)."""
        return dequantize_fp8_blockwise(self.codes, self.scale, self.block, dtype=dtype)


def check_groups(x: torch.Tensor, weight: Fp8Weight, groups: int) -> None:
    """One clear error for a grouped call whose shapes do not cut into ``groups`` runs."""
    out_features, in_features = weight.codes.shape
    if groups < 1 or out_features % groups:
        raise ValueError(f"fp8_linear: {out_features} weight rows do not split into {groups} groups")
    if x.shape[-1] != groups * in_features:
        raise ValueError(
            f"fp8_linear: input has {x.shape[-1]} columns, expected {groups} groups x {in_features} = "
            f"{groups * in_features}"
        )


@register("fp8_linear", REFERENCE)
def fp8_linear_reference(x: torch.Tensor, weight: Fp8Weight, dtype: torch.dtype, groups: int = 1) -> torch.Tensor:
    """``x @ W.T`` with the weight ``W`` dequantised to ``dtype`` (see :class:`Fp8Weight`).

    With ``groups`` > 1, ``x`` [..., groups * in] and the result [..., out]: group ``g``'s output columns are
    ``x[..., g*in:(g+1)*in] @ W[g*out/groups:(g+1)*out/groups].T``."""
    check_groups(x, weight, groups)
    return grouped_linear(x, weight.dequantized(dtype), groups)
