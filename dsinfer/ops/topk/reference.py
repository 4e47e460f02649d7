"""The truth for top-k: a stable descending sort keeps tied values in index order."""

from __future__ import annotations

import torch

from dsinfer.ops.registry import register


@register("topk_indices", "reference")
def topk_indices_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the ``k`` largest values along the last axis; among equal values the lowest index first.

    NaN is not a score the models produce; -inf marks entries a query must not see and sorts last.
    """
    if k < 0 or k > scores.shape[-1]:
        raise ValueError(f"k={k} outside 0..{scores.shape[-1]} (the width of the scores)")
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
