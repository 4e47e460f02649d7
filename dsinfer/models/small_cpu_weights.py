"""A small model served on a CPU holds its FP8 / FP4 weights as floats: the same values, no dequantising per step.

Kept in checkpoint precision, every decode step of the CPU reference dequantises each FP8 linear and each routed
expert it uses again: for the embedded default (19.8 MB on disk) that was about two thirds of a 60 ms step. The
dequantised values are exact (codes times power-of-two scales), so the floats give bit-identical logits; only
memory grows (about 4x the checkpoint's bytes in float32), which is why only checkpoints up to
:data:`SMALL_CHECKPOINT_BYTES` are held this way, and only on a CPU. ``$DSINFER_FP8_LINEARS`` still decides for
the FP8 linears when it is set.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dsinfer import envs
from dsinfer.layers.moe import MoE
from dsinfer.models.loader import INDEX_FILE
from dsinfer.ops.moe.weights import ExpertWeights, dequantize_expert

__all__ = ["SMALL_CHECKPOINT_BYTES", "dequantize_experts_", "is_small_cpu_checkpoint", "small_cpu_fp8_linears"]

SMALL_CHECKPOINT_BYTES = 64 * 2**20


def is_small_cpu_checkpoint(model_dir: str | Path, device: str | torch.device) -> bool:
    """Whether the checkpoint's index says it is at most :data:`SMALL_CHECKPOINT_BYTES` and it runs on a CPU."""
    if torch.device(device).type != "cpu":
        return False
    try:
        total = json.loads((Path(model_dir) / INDEX_FILE).read_text())["metadata"]["total_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return isinstance(total, int) and total <= SMALL_CHECKPOINT_BYTES


def small_cpu_fp8_linears(model_dir: str | Path, device: str | torch.device) -> str | None:
    """The loader's ``fp8_linears`` for this checkpoint: ``dequantize`` for a small one on a CPU unless
    ``$DSINFER_FP8_LINEARS`` is set; None (the loader's own default) otherwise."""
    if envs.FP8_LINEARS.get() or not is_small_cpu_checkpoint(model_dir, device):
        return None
    return "dequantize"


@torch.no_grad()
def dequantize_experts_(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace every MoE layer's packed FP4 experts by their exact float values; returns the layers changed."""
    changed = 0
    for module in model.modules():
        if not isinstance(module, MoE) or not module.is_packed:
            continue
        weights = module.routed_weights()
        if not weights.is_fp4:
            continue
        pairs = [dequantize_expert(weights, expert, dtype) for expert in range(weights.num_experts)]
        w13, w2 = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        module.pack(ExpertWeights(w13, None, w2, None, weights.intermediate_size, False), weights.num_experts)
        changed += 1
    return changed
