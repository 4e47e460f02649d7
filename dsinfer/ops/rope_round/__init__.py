"""``rope_and_round(RopeRoundInputs(x, cos, sin, weight, eps, rounding, block))``: a row's optional weighted
RMSNorm, its RoPE and V4.1's trained-in rounding in one op (the window KV, compressed KV and indexer chains of a
decode step). Its Triton backend is the row-chain kernel of :mod:`dsinfer.ops.norm_rope.row_chain_triton`.

``rope_round_store(RopeRoundStoreInputs.of(chain, data, scales, first, second, modulus, element, code_block,
scale))``: the same chain, its rows then written to a cache pool as ``cache_store`` writes them (coded or not), in
one Triton kernel (:mod:`dsinfer.ops.rope_round.store_triton`). :class:`RowChain` carries a chain's inputs from
the layer that has them to the cache write that runs it."""

from dsinfer.ops.rope_round import store_triton, triton  # noqa: F401  (registers the Triton backends)
from dsinfer.ops.rope_round.chain import RowChain
from dsinfer.ops.rope_round.reference import (
    ROUNDINGS,
    RopeRoundInputs,
    RopeRoundStoreInputs,
    rope_and_round_reference,
    rope_round_store_reference,
)

__all__ = [
    "ROUNDINGS",
    "RopeRoundInputs",
    "RopeRoundStoreInputs",
    "RowChain",
    "rope_and_round_reference",
    "rope_round_store_reference",
]
