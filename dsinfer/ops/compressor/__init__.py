"""``compressor_pool(values, gates, norm_weight, eps, dtype)``: a compressor's gated pooling of complete windows."""

from dsinfer.ops.compressor.reference import compressor_pool_reference

__all__ = ["compressor_pool_reference"]
