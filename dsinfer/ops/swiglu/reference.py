"""The truth for DeepSeek's clamped SwiGLU on a joined gate-and-up projection (the shared expert's activation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.ops.registry import REFERENCE, register


@register("clamped_swiglu", REFERENCE)
def clamped_swiglu_reference(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` [..., I] from ``gate_up`` [..., 2I] (gate first), in
    ``gate_up``'s dtype, rounded after each step as the expert's separate torch ops round."""
    inter = gate_up.shape[-1] // 2
    gate = gate_up[..., :inter].clamp(max=limit)
    up = gate_up[..., inter:].clamp(min=-limit, max=limit)
    return F.silu(gate) * up
