"""The truth for ``rope_angles``: torch's product of the positions and the frequencies, then its cos and sin."""

from __future__ import annotations

import torch

from dsinfer.ops.registry import REFERENCE, register


@register("rope_angles", REFERENCE)
def rope_angles_reference(
    positions: torch.Tensor, inv_freq: torch.Tensor, ratio: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [*positions.shape, rope_dim // 2], in float32, of ``positions`` (``ratio`` 1) or of
    ``positions - positions % ratio`` (the first position of each ``ratio``-token group; integer positions).

    Integer positions meet the float32 frequencies in the product itself (converted to float32 as they load, the
    same values a separate conversion gives): one kernel fewer."""
    if ratio < 1:
        raise ValueError(f"rope_angles: ratio must be >= 1, got {ratio}")
    if ratio > 1:
        if positions.is_floating_point():
            raise ValueError("rope_angles: a ratio > 1 needs integer positions")
        positions = positions - positions % ratio
    if positions.is_floating_point():
        positions = positions.to(torch.float32)
    if inv_freq.device != positions.device or inv_freq.dtype != torch.float32:
        inv_freq = inv_freq.to(device=positions.device, dtype=torch.float32)
    freqs = positions[..., None] * inv_freq
    return freqs.cos(), freqs.sin()
