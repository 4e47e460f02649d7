"""``index_topk_decode`` and ``candidate_block_mask``: V4.1's exact selections over index scores.

Backends: ``reference`` (torch: the packed-key top-k, a gather, a sort) and ``triton`` (CUDA: one program per query
row selects in registers by a bitwise search for the k-th key; rows wider than it holds go to the reference).
"""

from dsinfer.ops.index_select import triton  # noqa: F401  (registers the Triton backends)
from dsinfer.ops.index_select.reference import candidate_block_mask_reference, index_topk_decode_reference

__all__ = ["candidate_block_mask_reference", "index_topk_decode_reference"]
