"""The truth for greedy sampling: ``torch.argmax`` over the vocabulary."""

from __future__ import annotations

import torch

from dsinfer.ops.registry import REFERENCE, register


@register("greedy_argmax", REFERENCE)
def greedy_argmax_reference(scores: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: the column of each row's largest score in ``scores`` ``[B, V]`` (any float dtype), the lowest
    on ties; a row holding NaN gives its first NaN, as ``torch.argmax`` does."""
    return scores.argmax(dim=-1)
