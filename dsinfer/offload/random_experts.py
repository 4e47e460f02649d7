"""Random packed FP4 routed experts drawn straight where an offloaded model keeps them: the resident ones in the
GPU's arena slots, the others in pinned host memory. For measuring a model whose experts do not fit the host
and the GPU twice (V4-Flash: 147 GB of experts beside 128 GiB of RAM): no layer's experts ever exist whole in
one place, and the host store holds only the offloaded experts (a re-balance swaps).

The model must be built with its routed experts on the meta device (``build_native_model(...,
expert_device="meta")``): shapes only. Codes are uniform bytes drawn on the device (fast) and copied into the
pinned store; scales are the one ue8m0 byte per tensor kind that :mod:`dsinfer.models.native_random` uses.
"""

from __future__ import annotations

import torch

from dsinfer.models.native_random import draw_meta_experts
from dsinfer.offload.arena import ExpertArena, empty_like_rows
from dsinfer.offload.host_store import PARTS, HostStore
from dsinfer.offload.install import (
    REBALANCE_EVERY,
    ExpertOffload,
    attach_offload,
    backbone_moes,
    resident_per_layer,
)
from dsinfer.offload.residency import LayerResidency
from dsinfer.offload.stats import ExpertStats
from dsinfer.ops.moe import ExpertWeights

DRAW_ROWS = 8  # experts drawn on the device per round when filling the host store


def _fill(part: torch.Tensor, name: str, weights: ExpertWeights, generator: torch.Generator) -> None:
    """Random codes, or the scale byte that gives them a standard deviation near ``fan_in ** -0.5``."""
    from dsinfer.models.native_random import fp4_scale_byte

    if name.endswith("_scale"):
        part.fill_(fp4_scale_byte(weights.hidden_size if name == "w13_scale" else weights.intermediate_size))
    elif part.device.type == "cpu":
        part.random_(0, 256, generator=generator)
    else:  # in place, a few experts at a time: a GPU arena can be most of the GPU
        for start in range(0, part.shape[0], DRAW_ROWS):
            part[start : start + DRAW_ROWS].random_(0, 256, generator=generator)


def _host_rows(like: ExpertWeights, rows: int, device: torch.device, generator: torch.Generator) -> ExpertWeights:
    """``rows`` random experts in host memory (pinned on CUDA, drawn on the GPU a few experts at a time)."""
    host_rows = empty_like_rows(like, rows, "cpu", mapped_for=device if device.type == "cuda" else None)
    parts = []
    for name in PARTS:
        host = getattr(host_rows, name)
        for start in range(0, rows, DRAW_ROWS):
            block = host[start : start + DRAW_ROWS]
            drawn = torch.empty(block.shape, dtype=torch.uint8, device=device)
            _fill(drawn, name, like, generator)
            block.copy_(drawn)
        parts.append(host)
    return ExpertWeights(*parts, like.intermediate_size, like.is_fp4)


def offload_random_experts(
    model, resident_per_layer: int, seed: int = 0, fetch_ahead: bool | None = None
) -> ExpertOffload:
    """Draw every backbone MoE layer's experts in place: ``resident_per_layer`` (an even spread of ids) in the
    arena on the model's device, the rest in the host store; the model's :class:`ExpertOffload`."""
    moes = backbone_moes(model)
    like = moes[0][1].routed_weights()
    if not like.is_fp4 or like.w13.device.type != "meta":
        raise ValueError("build the model with expert_device='meta' (FP4 experts, shapes only)")
    experts, device = like.num_experts, model.embed.weight.device
    if not 0 <= resident_per_layer < experts:
        raise ValueError(f"resident experts per layer: expected 0..{experts - 1}, got {resident_per_layer}")
    generator = torch.Generator(device=device).manual_seed(seed + 7)
    stats = ExpertStats([layer_id for layer_id, _ in moes], experts, device)
    arena = ExpertArena(like, len(moes), resident_per_layer, experts - resident_per_layer, device)
    for name in PARTS:
        _fill(getattr(arena.weights, name), name, like, generator)
    wanted = stats.even_resident(resident_per_layer)
    offloaded = [e for e in range(experts) if e not in set(wanted)]
    layers = []
    for row, (_, moe) in enumerate(moes):
        host = HostStore(_host_rows(like, len(offloaded), device, generator), offloaded, experts, device)
        layers.append(LayerResidency(row, host, arena, stats, moe.ops, moe.gate))
        layers[-1].place(wanted, filled=True)
    return attach_offload(model, layers, stats, None, REBALANCE_EVERY, fetch_ahead)


def offload_dummy_experts(model, config, seed: int = 0):
    """Random experts for a model built with ``expert_device="meta"`` under the engine's ``expert_offload``: the
    backbone's drawn where the offload keeps them (:func:`offload_random_experts`, so V4-Flash's 147 GB of experts
    never sit whole in host memory), the drafter's on the device; every expert on the device when all fit. The
    model, with ``expert_offload`` set (None: nothing offloaded)."""
    moes = backbone_moes(model)
    device = model.embed.weight.device
    resident = resident_per_layer(model, config)
    if resident >= moes[0][1].routed_weights().num_experts:
        draw_meta_experts(model, device, seed)
        model.expert_offload = None
        return model
    offload_random_experts(model, resident, seed)
    draw_meta_experts(model, device, seed, skip=[moe for _, moe in moes])
    return model
