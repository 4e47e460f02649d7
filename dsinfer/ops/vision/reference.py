"""The truth for the vision tower's attention: per image, full (non-causal) softmax attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.ops.registry import REFERENCE, register


@register("vision_attention", REFERENCE)
def vision_attention_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """Attention of packed images: ``query`` / ``key`` / ``value`` [N, heads, head_dim] with the images'
    patch counts ``lengths`` (host ints, summing to N); output [N, heads, head_dim], scale 1/sqrt(head_dim)."""
    if sum(lengths) != query.shape[0]:
        raise ValueError(f"image lengths sum to {sum(lengths)}, the packed batch holds {query.shape[0]} patches")
    outputs, start = [], 0
    for length in lengths:
        rows = slice(start, start + length)
        q, k, v = (t[rows].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        outputs.append(F.scaled_dot_product_attention(q, k, v).squeeze(0).transpose(0, 1))
        start += length
    return torch.cat(outputs)
