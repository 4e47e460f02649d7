"""Configuration, parsed and validated once at the edge: the model (V4, and V4.1 on top of it) and the engine."""

from dsinfer.config.engine import ENGRAM_PLACEMENTS, KV_CACHE_DTYPES, EngineConfig
from dsinfer.config.model import (
    HF_LAYER_TYPE_NAMES,
    SUPPORTED_MODEL_TYPES,
    ConfigError,
    ModelConfig,
    ModelConfigBase,
    QuantizationConfig,
    YarnScaling,
    default_compress_ratios,
    is_v41_config,
)
from dsinfer.config.model_v41 import FP8_SCALE_BLOCK, V41_MARKER_KEYS, ModelConfigV41, engram_primes, is_prime
from dsinfer.config.speculative import SpeculativeConfig, parse_speculative_config

__all__ = [
    "ENGRAM_PLACEMENTS",
    "FP8_SCALE_BLOCK",
    "HF_LAYER_TYPE_NAMES",
    "KV_CACHE_DTYPES",
    "SUPPORTED_MODEL_TYPES",
    "V41_MARKER_KEYS",
    "ConfigError",
    "EngineConfig",
    "ModelConfig",
    "ModelConfigBase",
    "ModelConfigV41",
    "QuantizationConfig",
    "SpeculativeConfig",
    "YarnScaling",
    "default_compress_ratios",
    "engram_primes",
    "is_prime",
    "is_v41_config",
    "parse_speculative_config",
]
