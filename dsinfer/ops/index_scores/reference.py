"""The truth for the lightning indexer of both variants, tensors in and out.

score(t, w) = sum_h head_weight[t, h] * ReLU(q[t, h] . k[w]) / sqrt(d), in float32, with -inf at the entries
query t may not see yet (entry w needs all of its window: w < visible[t]). ``index_topk`` keeps the ``k``
best visible entries of each query as indices in ascending entry order (exact ties -> the lowest index, in
every backend), with a mask of which are real: the form a batched decode step gathers entries with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.ops.registry import REFERENCE, register
from dsinfer.ops.topk import topk_indices


def entry_scores(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor) -> torch.Tensor:
    """Every entry's score [n, W] in float32, nothing masked: ``sum_h head_weights[n, h] * ReLU(q[n, h] . key) /
    sqrt(d)``, keys [W, d] shared or [n, W, d] per query."""
    spec = "shd,wd->shw" if keys.dim() == 2 else "shd,swd->shw"
    per_head = F.relu(torch.einsum(spec, q.float(), keys.float())) * q.shape[-1] ** -0.5
    return (per_head * head_weights.float().unsqueeze(-1)).sum(dim=1)


@register("index_scores", REFERENCE)
def index_scores_reference(
    q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """Scores [n, W] of queries ``q`` [n, H, d] against keys [W, d] (shared) or [n, W, d] (per query).

    ``head_weights`` [n, H] are already scaled (V4 / V4.1: ``weights_proj(x) / sqrt(H)``); ``visible`` [n] is how
    many leading entries each query may see.
    """
    scores = entry_scores(q, keys, head_weights)
    hidden = torch.arange(scores.shape[-1], device=scores.device) >= visible[:, None]
    return scores.masked_fill(hidden, float("-inf"))


def top_k_in_order(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` best entries [n, k] in ascending entry order, and which are real (finite) [n, k]."""
    width = scores.shape[1]
    chosen = topk_indices(scores, min(k, width))
    real = scores.gather(1, chosen) > float("-inf")
    order = torch.sort(torch.where(real, chosen, chosen + width), dim=1).indices
    return chosen.gather(1, order), real.gather(1, order)


@register("index_topk", REFERENCE)
def index_topk_reference(
    q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, visible: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` chosen entries [n, min(k, W)] of each query (ascending) and which of them are real."""
    return top_k_in_order(index_scores_reference(q, keys, head_weights, visible), k)
