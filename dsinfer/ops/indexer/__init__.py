"""``indexer_topk_decode``: the lightning indexer's choice for one query token per sequence.

``indexer_topk_decode(PagedIndexInputs(q [B, nh, d] float32, head_weights [B, nh] float32, keys [blocks, per_block,
d], key_scales, block_tables [B, max_blocks], visible [B] int64), k) -> (chosen [B, k'], real [B, k'])`` with
``k' = min(k, max_blocks * per_block)``: score every entry slot of each sequence's block table,
``sum_h head_weights[h] * ReLU(q_h . key) / sqrt(d)``, mask the slots past ``visible``, keep the top ``k'``
(equal scores: lowest index first), and return them in position order with which of them are real. Backends:
``reference`` (torch, every device) and ``triton`` (CUDA: the scores in one kernel reading the keys through the
block table, then the reference's top-k).
"""

from dsinfer.ops.indexer import triton  # noqa: F401  (registers the backend)
from dsinfer.ops.indexer.reference import indexer_topk_decode_reference, select_visible_topk

__all__ = ["indexer_topk_decode_reference", "select_visible_topk"]
