"""The truth for the lightning indexer's decode step: score every entry slot of the block table, keep the top k."""

from __future__ import annotations

import torch

from dsinfer.ops.index_scores.reference import entry_scores, index_topk_reference, top_k_in_order
from dsinfer.ops.index_scores_paged.reference import PagedIndexInputs
from dsinfer.ops.registry import REFERENCE, register


def indexer_scores(q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """score [n, W] = sum_h head_weights[n, h] * ReLU(q[n, h] . key) / sqrt(d); keys [W, d] shared or [n, W, d]."""
    return entry_scores(q, keys, head_weights)


def select_visible_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``min(k, W)`` of ``scores`` [B, W] among the first ``visible`` [B] slots, in position order, and
    which of them are real (a row with fewer visible slots than k pads with masked ones after the real ones)."""
    seen = torch.arange(scores.shape[1], device=scores.device) < visible[:, None]
    return top_k_in_order(scores.masked_fill(~seen, float("-inf")), k)


@register("indexer_topk_decode", REFERENCE)
def indexer_topk_decode_reference(inputs: PagedIndexInputs, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top ``k`` of every slot of each sequence's block table (shapes: :class:`PagedIndexInputs`; the keys are
    the indexer compressor's entry pool), gathered whole so shapes never depend on values."""
    return index_topk_reference(inputs.q, inputs.gathered_keys(), inputs.head_weights, inputs.visible, k)
