"""``rope_and_round(x, cos, sin, weight, eps, rounding, block)``: a row's optional weighted RMSNorm, its RoPE and
V4.1's trained-in rounding in one op (the window KV, compressed KV and indexer chains of a decode step). Its
Triton backend is the row-chain kernel of :mod:`dsinfer.ops.norm_rope.row_chain_triton`."""

from dsinfer.ops.rope_round import triton  # noqa: F401  (registers the Triton backend)
from dsinfer.ops.rope_round.reference import ROUNDINGS, rope_and_round_reference

__all__ = ["ROUNDINGS", "rope_and_round_reference"]
