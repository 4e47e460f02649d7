"""Engram conditional memory of DeepSeek-V4.1: hashing (token ids -> table rows) and the compressed vocabulary."""

from dsinfer.engram.hashing import (
    ENGRAM_DEAD,
    EngramContext,
    EngramHasher,
    engram_primes,
    hash_multipliers,
    is_prime,
)
from dsinfer.engram.vocabulary import build_compressed_vocabulary, compressed_key, engram_normalizer

__all__ = [
    "ENGRAM_DEAD",
    "EngramContext",
    "EngramHasher",
    "build_compressed_vocabulary",
    "compressed_key",
    "engram_normalizer",
    "engram_primes",
    "hash_multipliers",
    "is_prime",
]
