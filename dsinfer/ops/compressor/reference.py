"""The truth for the compressors of both variants: softmax(gate)-weighted pooling per channel, then RMSNorm.

The pending-window bookkeeping (which tokens form a window, the overlap of CSA windows) stays in
``dsinfer.layers.compressor``; this is the arithmetic on complete windows, tensors in and out.
"""

from __future__ import annotations

import torch

from dsinfer.ops.norm_rope.reference import rms_norm_reference
from dsinfer.ops.registry import REFERENCE, register


@register("compressor_pool", REFERENCE)
def compressor_pool_reference(
    values: torch.Tensor, gates: torch.Tensor, norm_weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Entries [n, dim] (pre-RoPE) from windows ``values`` / ``gates`` [n, slots, dim].

    Each channel's weights are a softmax over the window's slots, taken in float32 and applied in ``values``'
    dtype (V4 pools in the model dtype, V4.1 in float32); the sum is cast to ``dtype`` and RMS-normalised.
    A slot whose gate is -inf (the missing predecessor of a first CSA window) gets weight 0.
    """
    weights = gates.softmax(dim=1, dtype=torch.float32).to(values.dtype)
    return rms_norm_reference((values * weights).sum(dim=1).to(dtype), norm_weight, eps)
