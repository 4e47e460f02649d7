"""``index_scores`` and ``index_topk``: the lightning indexer's scores, and its choice as top-k *indices*.

Backends: ``reference`` (torch, every device: the per-head products [n, H, W] in memory) and ``triton`` (CUDA:
the scores summed over heads in registers, one [n, W] write; the top-k is the reference's on those scores).
"""

from dsinfer.ops.index_scores import triton  # noqa: F401  (registers the backends)
from dsinfer.ops.index_scores.reference import index_scores_reference, index_topk_reference, top_k_in_order

__all__ = ["index_scores_reference", "index_topk_reference", "top_k_in_order"]
