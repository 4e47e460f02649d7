"""``rms_norm(x, weight, eps)``, ``rms_normalize(x, eps)`` (no weight), ``rope(x, cos, sin, inverse)`` and
``rms_normalize_rope(x, eps, cos, sin)`` (the query's norm and rotation in one pass): the norms and rotary
embedding of both variants. ``rms_normalize_rope``'s Triton backend (and ``rope``'s into a new tensor) is the
row-chain kernel of :mod:`~dsinfer.ops.norm_rope.row_chain_triton`, which ``rope_and_round`` also runs."""

from dsinfer.ops.norm_rope import rms_norm_triton, rope_triton, row_chain_triton  # noqa: F401  (backends)
from dsinfer.ops.norm_rope.reference import (
    rms_norm_reference,
    rms_normalize_reference,
    rms_normalize_rope_reference,
    rope_reference,
)

__all__ = ["rms_norm_reference", "rms_normalize_reference", "rms_normalize_rope_reference", "rope_reference"]
