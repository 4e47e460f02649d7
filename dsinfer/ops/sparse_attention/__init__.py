"""Shared-KV sparse attention over a sliding window and compressed entries: decode and prefill.

``sparse_attention_decode(SparseDecodeInputs(q [B, H, D], window [slots, W, D], slots [B], positions [B],
window_from [B], entries [blocks, per_block, D] | None, block_tables [B, max_blocks], indices [B, K] | None,
sink [H], softmax_scale)) -> [B, H, D]`` in ``q.dtype``. ``indices`` are entry numbers within each sequence's
block table, -1 where there is none. Backends: ``reference`` (torch, the truth, every device) and ``triton``
(CUDA: split-K over the keys with the sink, every head of a group against one loaded K=V tile, then a combine
over the splits).

``sparse_attention_prefill(SparsePrefillInputs(q [T, H, D], kv [T, D], positions [T], sequence_rows [B + 1],
starts [B], slots [B], window_from [B], window [slots, R, D], window_size, entries | None, block_tables,
indices [T, K] | None, compress_ratio, sink [H], softmax_scale, spans)) -> [T, H, D]``: every new token of a
packed batch over its window (new rows of this step, earlier positions from the ring) and its compressed entries
(CSA: ``indices``; HCA, indices None: every visible entry). Backends: ``reference`` (torch, per sequence) and
``triton`` (CUDA: one program per token and head group, online softmax over window and entry tiles, the sink in
the normaliser).
"""

from dsinfer.ops.sparse_attention import prefill_triton, triton  # noqa: F401  (register the backends)
from dsinfer.ops.sparse_attention.prefill_reference import sparse_attention_prefill_reference
from dsinfer.ops.sparse_attention.reference import sparse_attention_decode_reference

__all__ = ["sparse_attention_decode_reference", "sparse_attention_prefill_reference"]
