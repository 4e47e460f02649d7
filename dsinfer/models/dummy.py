"""``--load-format dummy`` (vLLM's spelling): a checkpoint directory's config and tokenizer, random weights.

For measuring a model's shape without its weights: ``config.json`` (and ``tokenizer.json``) are read as a real
checkpoint's would be, then the weights are drawn on the device in the release formats (routed experts packed
FP4 with ue8m0 scales, the rest in the compute dtype; :func:`~dsinfer.models.native_random.build_native_model`),
with no safetensors read. ``dsinfer make-slice`` writes such a directory for V4-Flash widths with a few layers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dsinfer.config import ConfigError, ModelConfig, ModelConfigV41
from dsinfer.models.deepseek_v4 import DeepseekV4
from dsinfer.models.deepseek_v41 import DeepseekV41
from dsinfer.models.loader import CheckpointError, engram_hasher_for
from dsinfer.models.native_random import build_native_model

LOAD_FORMATS = ("auto", "dummy")


def build_dummy_model(
    path: str | Path, dtype: torch.dtype, device: str | torch.device, seed: int = 0, expert_device=None
) -> DeepseekV4 | DeepseekV41:
    """The model ``path/config.json`` describes, with random weights in release precision (MTP / DSpark included
    when the config has them)."""
    directory = Path(path)
    try:
        config = ModelConfig.from_file(directory)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    with_mtp = bool(config.num_nextn_predict_layers)
    model = build_native_model(config, dtype, device, seed=seed, with_mtp=with_mtp, expert_device=expert_device)
    if isinstance(config, ModelConfigV41) and config.engram_layer_ids:
        model.attach_engram_hasher(engram_hasher_for(directory, config))
    return model
