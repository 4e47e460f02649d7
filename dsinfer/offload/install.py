"""Turn a loaded model's routed experts into offloaded ones: the layers' stacked experts become the host store,
an arena of device slots takes each layer's resident experts, and the MoE layers read through their tables.

The model is loaded with its routed experts in host memory (``load_model(..., expert_device="cpu")``: read
straight from the safetensors into host memory, never through the GPU); :func:`install_expert_offload` pins them
(CUDA), builds the arena on the model's device and hands each backbone MoE layer its
:class:`~dsinfer.offload.arena.LayerResidency`. Every ``rebalance_every`` steps, before the first offloaded layer
runs, the resident sets follow the counts and the counts are written to ``--expert-stats``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dsinfer.config import ConfigError
from dsinfer.layers.moe import MoE
from dsinfer.offload.arena import ExpertArena, LayerResidency
from dsinfer.config.expert_split import FETCH_BUFFERS, largest_split
from dsinfer.offload.stats import ExpertStats
from dsinfer.ops.moe import ExpertWeights

logger = logging.getLogger(__name__)
REBALANCE_EVERY = 64  # steps between re-balances of the resident sets (and writes of the stats file)
GIB = 2**30


class ExpertOffload:
    """Every offloaded layer of one model: the arena, the counts, and when to re-balance."""

    def __init__(self, layers: list[LayerResidency], stats: ExpertStats, stats_path: str | None, every: int) -> None:
        self.layers, self.stats, self.stats_path, self.every = layers, stats, stats_path, every
        self.steps = 0

    @property
    def arena(self) -> ExpertArena:
        return self.layers[0].arena

    def before_step(self) -> None:
        """Called as the first offloaded layer starts a step: re-balance when due (no layer is mid-step)."""
        self.steps += 1
        if self.steps % self.every == 0:
            self.rebalance()

    def rebalance(self) -> int:
        """Make each layer's most-routed experts resident and write the counts; how many experts moved in."""
        self.stats.snapshot()
        moved = sum(layer.rebalance() for layer in self.layers)
        if self.stats_path is not None:
            self.stats.save(self.stats_path)
        return moved

    def hit_rate(self) -> float:
        """Fraction of expert reads served by resident experts (1.0 before any read)."""
        served = self.arena.served_experts
        return 1.0 if not served else 1 - self.arena.fetched_experts / served


def resident_for_budget(budget_gib: float, layers: int, experts: int, expert_bytes: int) -> int:
    """The most resident experts per layer that fit ``budget_gib`` with the fetch buffers (the plan's rule)."""
    split = largest_split(experts, layers, expert_bytes, int(budget_gib * GIB))
    if split is not None:
        return split.resident
    raise ConfigError(f"--expert-offload {budget_gib:g} GiB cannot hold even the fetch buffers "
                      f"({FETCH_BUFFERS} x {experts} experts of {expert_bytes} bytes); raise it")  # fmt: skip


def backbone_moes(model: torch.nn.Module) -> list[tuple[int, MoE]]:
    """The model's backbone MoE layers with their layer ids (the drafter's stay resident)."""
    return [(layer_id, block.ffn) for layer_id, block in enumerate(model.layers) if isinstance(block.ffn, MoE)]


def install_expert_offload(
    model: torch.nn.Module,
    resident_per_layer: int,
    stats_path: str | Path | None = None,
    rebalance_every: int = REBALANCE_EVERY,
) -> ExpertOffload | None:
    """Keep ``resident_per_layer`` experts of each backbone MoE layer on the model's device, the rest in host
    memory; None (nothing changed) when every expert stays resident."""
    moes = backbone_moes(model)
    if not moes or any(not moe.is_packed for _, moe in moes):
        raise ConfigError("expert offload needs a loaded model (routed experts stacked in checkpoint form)")
    if any(moe.expert_parallel is not None for _, moe in moes):
        raise ConfigError("expert offload with expert parallelism is not supported yet; use one rank")
    experts = moes[0][1].n_experts
    if not 0 <= resident_per_layer <= experts:
        raise ConfigError(f"resident experts per layer: expected 0..{experts}, got {resident_per_layer}")
    if resident_per_layer == experts:
        return None
    device = model.embed.weight.device
    stats = ExpertStats([layer_id for layer_id, _ in moes], experts, device)
    if stats_path is not None:
        stats.load(stats_path)
    like = moes[0][1].routed_weights()
    arena = ExpertArena(like, len(moes), resident_per_layer, experts - resident_per_layer, device)
    layers = [LayerResidency(row, _host_store(moe.routed_weights()), arena, stats) for row, (_, moe) in enumerate(moes)]
    offload = ExpertOffload(layers, stats, None if stats_path is None else str(stats_path), rebalance_every)
    layers[0].before_step = offload.before_step
    for layer, (_, moe) in zip(layers, moes, strict=True):
        moe.expert_residency = layer
    logger.info("expert offload: %d of %d experts per layer resident in %d layers, the rest in host memory",
                resident_per_layer, experts, len(moes))  # fmt: skip
    return offload


def _host_store(weights: ExpertWeights) -> ExpertWeights:
    """The layer's experts as the host keeps them: on CUDA pinned (copies to the GPU run asynchronously)."""
    if weights.w13.device.type != "cpu" or not torch.cuda.is_available():
        return weights

    def pinned(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.pin_memory()

    parts = (pinned(weights.w13), pinned(weights.w13_scale), pinned(weights.w2), pinned(weights.w2_scale))
    return ExpertWeights(*parts, weights.intermediate_size, weights.is_fp4)


def offload_experts(model: torch.nn.Module, config) -> torch.nn.Module:
    """Apply the engine's ``expert_offload`` to a loaded model (its routed experts in host memory); the model.

    A GiB budget gives the routed experts that much of the GPU (resident slots plus fetch buffers). ``auto``
    gives them what the GPU has left after the other weights, the engine's work share and a cache of
    ``max_num_seqs`` full-length sequences; on the CPU (host and device are one memory) everything stays resident.
    """
    if config.expert_offload is None:
        return model
    if model.embed.weight.device.type == "cuda" and not config.enforce_eager:
        raise ConfigError("--expert-offload finds misses on the host, which a CUDA graph cannot capture yet: "
                          "add --enforce-eager")  # fmt: skip
    moes = backbone_moes(model)
    experts, like = moes[0][1].n_experts, moes[0][1].routed_weights()
    expert_bytes = like.nbytes // like.num_experts
    if config.expert_offload != "auto":
        resident = resident_for_budget(float(config.expert_offload), len(moes), experts, expert_bytes)
    elif model.embed.weight.device.type != "cuda":
        resident = experts
    else:
        resident = resident_for_budget(_auto_budget_gib(model, config), len(moes), experts, expert_bytes)
    offload = install_expert_offload(model, resident, config.expert_stats)
    model.expert_offload = offload
    return model


def _auto_budget_gib(model: torch.nn.Module, config) -> float:
    """GiB the routed experts may take on this GPU: free memory less the engine's work share and the cache."""
    from dsinfer.memory_plan import PlanRequest, build_plan

    device = model.embed.weight.device
    free, total = torch.cuda.mem_get_info(device)
    max_model_len = config.resolved_max_model_len(model.config)
    dtype_bytes = model.embed.weight.element_size()
    request = PlanRequest(model.config, max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
                          dtype_bytes=dtype_bytes, block_tokens=config.block_tokens)  # fmt: skip
    cache = config.max_num_seqs * build_plan(request).per_sequence
    return max(0, free - total * (1 - config.gpu_memory_utilization) - cache) / GIB
