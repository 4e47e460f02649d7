"""The truth for the Engram gate (Hugging Face ``DeepseekV41Engram``), tensors in and out.

For each token t and stream c, with h = streams[t, c] and k = key[t, c] (float32):

    dot  = sum(h * weight[c] * k) * rstd(h) * rstd(k) / sqrt(hidden),   rstd(v) = 1 / sqrt(mean(v^2) + eps)
    gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))                  (0 where ``gate_mask`` is False)
    out  = h + gate * value[t]

``weight`` is the product of the checkpoint's ``q_weight`` and ``k_weight`` (only the product matters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.registry import REFERENCE, register

GATE_MAGNITUDE_FLOOR = 1e-6


@dataclass(frozen=True)
class EngramGateInputs:
    """One Engram layer's gate: streams [T, hc, hidden]; key [T, hc, hidden]; value [T, hidden]; weight [hc, hidden]
    float32; gate_mask [T] bool or None (None: every token gated); eps of both RMS factors."""

    streams: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    weight: torch.Tensor
    gate_mask: torch.Tensor | None
    eps: float


@register("engram_gate", REFERENCE)
def engram_gate_reference(inputs: EngramGateInputs) -> torch.Tensor:
    """The new streams in their dtype (shapes: :class:`EngramGateInputs`)."""
    streams, weight, value, gate_mask, eps = inputs.streams, inputs.weight, inputs.value, inputs.gate_mask, inputs.eps
    hidden = streams.shape[-1]
    key = inputs.key.float()
    h = streams.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * weight * key).sum(-1) * rstd * hidden**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_MAGNITUDE_FLOOR).sqrt(), dot))
    if gate_mask is not None:
        gate = gate.masked_fill(~gate_mask.unsqueeze(-1), 0.0)
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
