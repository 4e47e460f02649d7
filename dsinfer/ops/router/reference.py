"""The truth for the MoE router's pick, from the router's logits: the scores ``sqrt(softplus(logits / gate_temp))``,
the top-k experts by score plus bias (the image bias for image tokens; or a token's fixed experts from the hash
table), and their mixing weights from the unbiased scores, normalised over the pick and scaled.

This is the arithmetic the router always ran in torch (a division, softplus, a square root, the bias's float copy
and the per-token bias choice, then the pick); a backend takes the whole chain so that it is one kernel after the
logits' GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsinfer.ops.registry import REFERENCE, register
from dsinfer.ops.topk import topk_indices


def route_scores(logits: torch.Tensor, gate_temp: float) -> torch.Tensor:
    """``sqrt(softplus(logits / gate_temp))`` (no division when ``gate_temp`` is 1)."""
    if gate_temp != 1.0:
        logits = logits / gate_temp
    return F.softplus(logits).sqrt()


@dataclass(frozen=True)
class MoeRouteInputs:
    """The router's logits and what its pick reads (shapes: :func:`moe_route_reference`)."""

    logits: torch.Tensor
    gate_temp: float
    bias: torch.Tensor | None
    bias_vl: torch.Tensor | None
    image_mask: torch.Tensor | None
    hash_table: torch.Tensor | None
    token_ids: torch.Tensor | None
    k: int
    normalize: bool
    scaling: float


@register("moe_route", REFERENCE)
def moe_route_reference(inputs: MoeRouteInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] (int64) and float32 weights [T, k] from the router's ``logits`` [T, E] (float32).

    ``hash_table`` [V, k] (hash routing, with the tokens' ``token_ids`` [T]) replaces the pick by
    ``hash_table[token_ids]``; otherwise the k best of ``scores + bias`` (``bias`` [E], any float dtype; where
    ``image_mask`` [T] is set and ``bias_vl`` [E] is given, ``bias_vl`` instead), best first, equal values lowest
    expert first. The weights are the picked experts' unbiased scores, divided by their sum (plus 1e-20) when
    ``normalize``, times ``scaling``.
    """
    bias, bias_vl, image_mask = inputs.bias, inputs.bias_vl, inputs.image_mask
    scores = route_scores(inputs.logits, inputs.gate_temp)
    if inputs.hash_table is not None:
        experts = inputs.hash_table[inputs.token_ids].long()
    else:
        bias = bias.float()
        if image_mask is not None and bias_vl is not None:  # per token on the device: no host read
            bias = torch.where(image_mask[:, None], bias_vl.float(), bias.expand_as(scores))
        experts = topk_indices(scores + bias, inputs.k)
    weights = scores.gather(1, experts)
    if inputs.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return experts, weights * inputs.scaling
