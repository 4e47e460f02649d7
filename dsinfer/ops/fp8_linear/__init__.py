"""``fp8_linear(x, Fp8Weight(codes, scale, block), dtype, groups=1)``: a linear layer over block-scaled FP8 e4m3
weights as stored (``groups`` > 1: a grouped projection, each run of rows against its own run of input columns)."""

from dsinfer.ops.fp8_linear import triton  # noqa: F401  (registers the Triton backend)
from dsinfer.ops.fp8_linear.reference import Fp8Weight, fp8_linear_reference

__all__ = ["Fp8Weight", "fp8_linear_reference"]
