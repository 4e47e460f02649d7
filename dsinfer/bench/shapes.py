"""Model shapes for measuring without weights: V4-Flash widths with only a few layers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from dsinfer.config import ModelConfig
from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer


def flash_slice_config(num_layers: int) -> ModelConfig:
    """Every V4-Flash width (hidden 4096, 64 x 512 heads, 256 experts x 2048, indexer 64 x 128, window 128) with
    ``num_layers`` layers cycling window / CSA / HCA, one hash-routed layer and no MTP."""
    kinds = (0, 4, 128)
    ratios = tuple(kinds[i % 3] for i in range(num_layers))
    return replace(
        ModelConfig(),
        num_hidden_layers=num_layers,
        compress_ratios=ratios,
        num_hash_layers=1,
        num_nextn_predict_layers=0,
    )


def write_slice_directory(directory: str | Path, num_layers: int) -> Path:
    """``config.json`` of :func:`flash_slice_config` and a tokenizer of its whole vocabulary, no weights: what
    ``--load-format dummy`` serves (random prompts need only the ids; the tokenizer's pieces are synthetic, and
    every one decodes to text, so a served stream carries a chunk per token as a real model's does)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = flash_slice_config(num_layers)
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    build_tiny_tokenizer(directory, vocab_size=config.vocab_size, filler="words")
    return directory
