"""Model shapes for measuring without weights: V4-Flash widths with only a few layers."""

from __future__ import annotations

from dataclasses import replace

from dsinfer.config import ModelConfig


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
