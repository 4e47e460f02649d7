"""``hc_collapse(streams, pre)`` and ``hc_expand(block_output, streams, post, comb)``: mHC's two stream steps.

Every transformer block runs each twice (attention site and FFN site): the collapse turns the ``n`` residual
streams [T, n, D] into the block's input [T, D], the expand spreads the block's output back and mixes the old
streams. Both are memory-bound, so the Triton backend reads each stream row once and writes each output once.
"""

from dsinfer.ops.mhc import triton  # noqa: F401  (registers the backend)
from dsinfer.ops.mhc.reference import hc_collapse_reference, hc_expand_reference

__all__ = ["hc_collapse_reference", "hc_expand_reference"]
