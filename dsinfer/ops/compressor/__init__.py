"""A compressor's arithmetic: ``compressor_pool`` (gated pooling of complete windows, prefill),
``compressor_decode`` (one decode token per sequence through its state slot) and ``compressor_decode_store``
(the same with V4's RoPE and the entry's write into its cache block), and ``decode_entry_location`` (where a
decode entry goes: its block and row, or the trash block)."""

from dsinfer.ops.compressor import decode_triton, location_triton  # noqa: F401  (registers the Triton backends)
from dsinfer.ops.compressor.reference import (
    CompressorDecodeInputs,
    CompressorStoreInputs,
    compressor_decode_reference,
    compressor_decode_store_reference,
    compressor_pool_reference,
    decode_entry_location,
)

__all__ = [
    "CompressorDecodeInputs",
    "CompressorStoreInputs",
    "compressor_decode_reference",
    "compressor_decode_store_reference",
    "compressor_pool_reference",
    "decode_entry_location",
]
