"""The truth for the MoE router's pick: the top-k experts by score plus bias (or a token's fixed experts), and
their mixing weights from the unbiased scores, normalised over the pick and scaled.

The scores themselves (``sqrt(softplus(logits))``) stay with the router: they are two elementwise kernels, and
computing them in torch keeps every backend's selection on exactly the same numbers.
"""

from __future__ import annotations

import torch

from dsinfer.ops.registry import REFERENCE, register
from dsinfer.ops.topk import topk_indices


@register("moe_route", REFERENCE)
def moe_route_reference(
    scores: torch.Tensor,
    bias: torch.Tensor | None,
    fixed_experts: torch.Tensor | None,
    k: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] (int64) and float32 weights [T, k] from ``scores`` [T, E] (float32).

    ``fixed_experts`` [T, k] (hash routing) replaces the pick; otherwise the k best of ``scores + bias`` (``bias``
    [E], or [T, E] per token), best first, equal values lowest expert first. The weights are the picked experts'
    unbiased scores, divided by their sum (plus 1e-20) when ``normalize``, times ``scaling``.
    """
    if fixed_experts is not None:
        experts = fixed_experts.long()
    else:
        experts = topk_indices(scores + bias, k)
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, weights * scaling
