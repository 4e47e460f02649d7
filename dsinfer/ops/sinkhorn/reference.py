"""The truth for Sinkhorn-Knopp in mHC: alternate column and row normalisation, column first (as DeepSeek's)."""

from __future__ import annotations

import torch

from dsinfer.ops.registry import REFERENCE, register


@register("sinkhorn", REFERENCE)
def sinkhorn_reference(comb: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """Normalise the last two axes of ``comb`` [..., n, n]: columns, then ``iterations - 1`` rounds of rows and
    columns, each divided by its sum plus ``eps``."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb
