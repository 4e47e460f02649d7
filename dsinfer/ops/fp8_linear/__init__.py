"""``fp8_linear(x, codes, scale, block, dtype)``: a linear layer over block-scaled FP8 e4m3 weights as stored."""

from dsinfer.ops.fp8_linear.reference import fp8_linear_reference

__all__ = ["fp8_linear_reference"]
