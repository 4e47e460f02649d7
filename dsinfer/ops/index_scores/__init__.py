"""``index_scores`` and ``index_topk``: the lightning indexer's scores, and its choice as top-k *indices*."""

from dsinfer.ops.index_scores.reference import index_scores_reference, index_topk_reference, top_k_in_order

__all__ = ["index_scores_reference", "index_topk_reference", "top_k_in_order"]
