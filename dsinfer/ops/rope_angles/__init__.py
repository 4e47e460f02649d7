"""``rope_angles(positions, inv_freq, ratio=1)``: cos and sin of the RoPE angles of positions (or of the first
position of each position's ``ratio``-token group), float32 [N, rope_dim // 2]."""

from dsinfer.ops.rope_angles import triton  # noqa: F401  (registers the Triton backend)
from dsinfer.ops.rope_angles.reference import rope_angles_reference

__all__ = ["rope_angles_reference"]
