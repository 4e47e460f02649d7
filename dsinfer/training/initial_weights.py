"""Start a training run from a released checkpoint: its weights, dequantised, become the trainer's master weights.

A fine-tune of the shipped default on a new data mix costs a fraction of a run from random weights. The
release files hold FP8 32x32 blocks, packed FP4 experts and FP8 Engram rows; the normal loader reads them
(FP8 linears dequantised) and :func:`~dsinfer.models.expert_packing.dequantized_state_dict` gives every weight
back as float under the trainer's own names. Rounding those floats again at export gives the same codes, so a
run of zero steps would ship the checkpoint it started from.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from dsinfer.config import FP8_SCALE_BLOCK
from dsinfer.models.deepseek_v41 import DeepseekV41
from dsinfer.models.expert_packing import dequantized_state_dict
from dsinfer.models.loader import CheckpointError, load_model

__all__ = ["TOKENIZER_FILES", "copy_tokenizer", "load_initial_weights"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def copy_tokenizer(source: Path, destination: Path) -> None:
    """The run keeps the checkpoint's tokenizer: its embedding rows are only meaningful for those ids."""
    for name in TOKENIZER_FILES:
        if not (source / name).is_file():
            raise CheckpointError(f"{source}: no {name} to start the run from")
        shutil.copyfile(source / name, destination / name)


@torch.no_grad()
def load_initial_weights(model: DeepseekV41, directory: Path) -> int:
    """Fill ``model`` (a trainer's model of the same config) from the checkpoint in ``directory``; returns how
    many tensors were loaded. Raises :class:`CheckpointError` naming the first config field that differs."""
    loaded = load_model(directory, progress=False, fp8_linears="dequantize", engram_placement="device")
    for key, value in loaded.config.to_dict().items():
        wanted = model.config.to_dict().get(key)
        if value != wanted:
            raise CheckpointError(f"{directory}: config field {key!r} is {value!r}, the run's model has {wanted!r}")
    state = dequantized_state_dict(loaded)
    for name in [n for n in state if n.endswith("engram.embed.weight")]:
        # FP8 rows with a ue8m0 scale per 32 channels -> float rows with unit scales (the trainer's layout)
        scale_name = name[: -len("weight")] + "scale"
        state[name] = state[name].float() * state[scale_name].float().repeat_interleave(FP8_SCALE_BLOCK, -1)
        state[scale_name] = torch.ones_like(state[scale_name], dtype=torch.float32)
    targets = model.state_dict()
    model.load_state_dict({name: state[name].to(targets[name].dtype) for name in targets}, strict=True)
    return len(targets)
