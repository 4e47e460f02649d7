"""``cache_encode(values, element, block, scale)`` / ``cache_decode(codes, scales, element, block, scale, dtype)``:
V4.1's block-scaled cache codecs (the formats are described in :mod:`dsinfer.kv.codecs`)."""

from dsinfer.ops.cache_codec import triton  # noqa: F401  (registers the Triton backends)
from dsinfer.ops.cache_codec.reference import cache_decode_reference, cache_encode_reference

__all__ = ["cache_decode_reference", "cache_encode_reference"]
