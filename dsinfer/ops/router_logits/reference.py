"""The truth for the router's logits: the bf16 hidden states against the float32 router weight, in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.ops.registry import REFERENCE, register


@register("router_logits", REFERENCE)
def router_logits_reference(x: torch.Tensor, weight: torch.Tensor, weight_parts: torch.Tensor | None) -> torch.Tensor:
    """``x`` [T, hidden] times ``weight`` [E, hidden]^T in float32, [T, E]. ``weight_parts`` (the weight split into
    bf16 parts, :func:`bf16_parts`) is for backends that use it; the reference ignores it."""
    return F.linear(x.float(), weight.float())


def bf16_parts(weight: torch.Tensor) -> torch.Tensor:
    """The weight [E, hidden] as bf16 parts stacked [parts * E, hidden] whose sum is the weight exactly: a bf16
    weight is its own one part; a float32 one splits into three (hi, mid, lo), each taking the next 8 significant
    bits of what the ones before left (8 + 8 + 8 = float32's 24)."""
    if weight.dtype == torch.bfloat16:
        return weight
    hi = weight.to(torch.bfloat16)
    rest = weight.float() - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return torch.cat([hi, mid, lo])
