"""The truth for a decode step's index scores over paged keys: the lightning indexer's scores (``index_scores``)
of each sequence's query against the keys of every slot of its block table.

``keys`` is the pool [blocks, per_block, d] in the model dtype, or with ``key_scales`` [blocks, per_block,
d / block] (ue8m0 exponent bytes) packed FP4 e2m1 codes [blocks, per_block, d / 2] (the index-key format of
:mod:`dsinfer.kv.codecs`). Slots past a sequence's ``visible`` entries score -inf, whatever their keys hold.
"""

from __future__ import annotations

import torch

from dsinfer.ops.cache_codec.reference import cache_decode_reference
from dsinfer.ops.index_scores.reference import index_scores_reference
from dsinfer.ops.registry import REFERENCE, register


@register("index_scores_paged", REFERENCE)
def index_scores_paged_reference(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    key_scales: torch.Tensor | None,
    block_tables: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """Scores [B, max_blocks * per_block] float32 of q [B, H, d] (head weights [B, H], already scaled)."""
    if key_scales is None:
        gathered = keys[block_tables]
    else:
        codes = keys.view(torch.uint8)[block_tables]
        scales = key_scales.view(torch.uint8)[block_tables]
        gathered = cache_decode_reference(
            codes, scales, "e2m1", q.shape[-1] // scales.shape[-1], "ue8m0", torch.float32
        )
    return index_scores_reference(q, gathered.flatten(1, 2), head_weights, visible)
