"""``sparse_attention_decode``: one query token per sequence over its window ring and selected compressed entries.

``sparse_attention_decode(q [B, H, D], window [slots, W, D], slots [B], positions [B], window_from [B],
entries [blocks, per_block, D] | None, block_tables [B, max_blocks], indices [B, K] | None, sink [H],
softmax_scale) -> [B, H, D]`` in ``q.dtype``. ``indices`` are entry numbers within each sequence's block table,
-1 where there is none. Backends: ``reference`` (torch, the truth, every device) and ``triton`` (CUDA: split-K
over the keys with the sink, every head of a group against one loaded K=V tile, then a combine over the splits).
"""

from dsinfer.ops.sparse_attention import triton  # noqa: F401  (registers the backend)
from dsinfer.ops.sparse_attention.reference import sparse_attention_decode_reference

__all__ = ["sparse_attention_decode_reference"]
