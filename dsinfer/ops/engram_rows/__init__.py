"""``engram_decode_rows``: a decode step's Engram row ids, each sequence's look-back history advanced in place.

Backends: ``reference`` (torch: the hasher's decode arithmetic) and ``triton`` (CUDA: one program per sequence).
"""

from dsinfer.ops.engram_rows import triton  # noqa: F401  (registers the Triton backend)
from dsinfer.ops.engram_rows.reference import (
    ENGRAM_DEAD,
    EngramRowHashing,
    engram_decode_rows_reference,
    rolling_hash,
)

__all__ = ["ENGRAM_DEAD", "EngramRowHashing", "engram_decode_rows_reference", "rolling_hash"]
