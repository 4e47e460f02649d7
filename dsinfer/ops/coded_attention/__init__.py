"""``sparse_attention_decode_coded``: V4.1's decode attention over a cache kept as FP8 / FP4 codes plus scales.

Backends: ``reference`` (torch: decode the rows the step reads, then V4's decode attention reference) and
``triton`` (CUDA: V4's split-K decode kernel with the codes decoded as each tile loads).
"""

from dsinfer.ops.coded_attention import triton  # noqa: F401  (registers the Triton backend)
from dsinfer.ops.coded_attention.reference import sparse_attention_decode_coded_reference

__all__ = ["sparse_attention_decode_coded_reference"]
