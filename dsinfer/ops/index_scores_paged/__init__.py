"""``index_scores_paged``: a decode step's index scores read straight from the paged index keys (plain or FP4-coded).

Backends: ``reference`` (torch: gather every block-table slot's keys, decode them, score) and ``triton`` (CUDA:
one program per sequence and tile of slots reads its keys through the block table, decoding FP4 as it loads).
"""

from dsinfer.ops.index_scores_paged import triton  # noqa: F401  (registers the Triton backend)
from dsinfer.ops.index_scores_paged.reference import PagedIndexInputs, index_scores_paged_reference

__all__ = ["PagedIndexInputs", "index_scores_paged_reference"]
