"""``hc_collapse(streams, pre)`` and ``hc_expand(block_output, streams, post, comb)``: mHC's two stream steps;
``hc_mixes(streams, fn, norm_eps)`` and ``hc_weights(mixes, base, scale, iterations, hc_eps)``: the weights that
drive them.

Every transformer block runs each twice (attention site and FFN site): the collapse turns the ``n`` residual
streams [T, n, D] into the block's input [T, D], the expand spreads the block's output back and mixes the old
streams. Both are memory-bound, so the Triton backend reads each stream row once and writes each output once.
Before each collapse the mixes project the RMS-normalised streams to the site's raw weights; their Triton
backend reads the streams once too, instead of writing and re-reading a normalised float32 copy; the weights'
backend turns each token's mixes into ``pre``, ``post`` and Sinkhorn's ``comb`` in one launch instead of ~13.
``hc_site_input(HcSiteInputs(streams, fn, base, scale, iterations, hc_eps, norm_eps, carried_mix))`` is a
site's mixes, weights and collapse together, returned as two halves (:mod:`dsinfer.ops.mhc.site_parts`) so that
the weights can run beside the block: at decode its backend runs them in three launches instead of four.
``hc_head(streams, fn, base, scale, hc_eps, norm_eps)`` is V4's last collapse, with weights from the streams' own
mixes: at decode two launches.
"""

from dsinfer.ops.mhc import head_triton, mixes_triton, site_triton, triton, weights_triton  # noqa: F401  (backends)
from dsinfer.ops.mhc.reference import (
    HcSiteInputs,
    hc_collapse_reference,
    hc_expand_reference,
    hc_head_reference,
    hc_mixes_reference,
    hc_site_input_reference,
    hc_weights_reference,
)

__all__ = [
    "HcSiteInputs",
    "hc_collapse_reference",
    "hc_expand_reference",
    "hc_head_reference",
    "hc_mixes_reference",
    "hc_site_input_reference",
    "hc_weights_reference",
]
