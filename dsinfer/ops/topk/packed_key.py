"""Top-k over one integer key per element: the score's order-preserving bits, then the inverted index.

A float32 score maps to a signed int32 that orders the same way (flip the magnitude bits of negatives). Put
in the upper 32 bits of an int64, with ``width - 1 - index`` in the lower ones, every key is distinct, and
``torch.topk`` over the keys is exact and tie-free: equal scores come out lowest index first. One topk, no
sort of the whole row, no host synchronisation, the same answer on every device.
"""

from __future__ import annotations

import torch

from dsinfer.ops.registry import register


def _ordered_int32(scores: torch.Tensor) -> torch.Tensor:
    bits = scores.float().contiguous().view(torch.int32)
    # Negative floats order backwards by their bits: flip everything but the sign.
    flipped = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # a Python int: no host-to-device copy
    # -0.0 and +0.0 are equal scores: one key for both.
    return torch.where(scores.float() == 0, torch.zeros_like(flipped), flipped)


@register("topk_indices", "packed_key", priority=10)
def topk_indices_packed_key(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Same result as :func:`~dsinfer.ops.topk.reference.topk_indices_reference` for float inputs."""
    width = scores.shape[-1]
    if k < 0 or k > width:
        raise ValueError(f"k={k} outside 0..{width} (the width of the scores)")
    if k == 0:
        return torch.zeros(*scores.shape[:-1], 0, dtype=torch.long, device=scores.device)
    index = torch.arange(width, device=scores.device, dtype=torch.int64)
    keys = (_ordered_int32(scores).to(torch.int64) << 32) | (width - 1 - index)
    return torch.topk(keys, k, dim=-1, sorted=True).indices
