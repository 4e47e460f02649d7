"""``rms_norm(x, weight, eps)``, ``rms_normalize(x, eps)`` (no weight) and ``rope(x, cos, sin, inverse)``: the norms
and rotary embedding of both variants."""

from dsinfer.ops.norm_rope import rms_norm_triton, rope_triton  # noqa: F401  (register the backends)
from dsinfer.ops.norm_rope.reference import rms_norm_reference, rms_normalize_reference, rope_reference

__all__ = ["rms_norm_reference", "rms_normalize_reference", "rope_reference"]
