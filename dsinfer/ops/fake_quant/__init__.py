"""V4.1's trained-in fake quantization as ops: ``fake_quant_fp8(x, block)`` and ``fake_quant_fp4(x, block,
e4m3_scales)``, plus the :class:`ActivationQuantizer` the model rounds its activations through."""

from dsinfer.ops.fake_quant import triton  # noqa: F401  (registers the Triton backends)
from dsinfer.ops.fake_quant.reference import (
    COMPRESSED_KV_BLOCK,
    FP4_E4M3_AMAX_FLOOR,
    FP4_UE8M0_AMAX_FLOOR,
    FP8_AMAX_FLOOR,
    INDEX_BLOCK,
    WINDOW_KV_BLOCK,
    ActivationQuantizer,
    e2m1_values,
    fake_quant_compressed_kv,
    fake_quant_fp4,
    fake_quant_fp8,
    fake_quant_index,
    fake_quant_window_kv,
    fp4_block_codes,
    fp4_block_scale,
    fp8_block_codes,
    pow2_ceil,
)

__all__ = [
    "COMPRESSED_KV_BLOCK",
    "FP4_E4M3_AMAX_FLOOR",
    "FP4_UE8M0_AMAX_FLOOR",
    "FP8_AMAX_FLOOR",
    "INDEX_BLOCK",
    "WINDOW_KV_BLOCK",
    "ActivationQuantizer",
    "e2m1_values",
    "fake_quant_compressed_kv",
    "fake_quant_fp4",
    "fake_quant_fp8",
    "fake_quant_index",
    "fake_quant_window_kv",
    "fp4_block_codes",
    "fp4_block_scale",
    "fp8_block_codes",
    "pow2_ceil",
]
