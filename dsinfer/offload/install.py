"""Turn a loaded model's routed experts into offloaded ones: an arena of device slots takes each layer's resident
experts, a host store the others, and the MoE layers read through their tables (:mod:`dsinfer.offload.residency`:
misses found and fetched on the device, so decode steps stay capturable).

The engine loads the model with its routed experts deferred (``load_model(..., expert_device="meta")``): every
other weight is on the device, and :func:`install_expert_offload` reads each expert once from the shards straight
into its arena slot or its row of a pinned host store of only the offloaded experts
(:mod:`dsinfer.offload.streaming`). A model loaded with its experts in host memory (``expert_device="cpu"``)
works too: its stacked experts are pinned and become the host store (every expert, or the offloaded ones). Every
``rebalance_every`` steps, between steps, the resident sets follow the counts and the counts are written to
``--expert-stats``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dsinfer.config import ConfigError
from dsinfer.config.expert_split import FETCH_BUFFERS, HOST_KEEPS_EVERY_EXPERT, fetch_ahead_by_default, largest_split
from dsinfer.layers.moe import MoE
from dsinfer.offload.arena import ExpertArena
from dsinfer.offload.host_store import PARTS, HostStore
from dsinfer.offload.residency import LayerResidency
from dsinfer.offload.stats import ExpertStats
from dsinfer.offload.streaming import stream_offloaded, stream_resident
from dsinfer.offload.traffic import OffloadTraffic, TrafficReader
from dsinfer.ops.moe import ExpertWeights

logger = logging.getLogger(__name__)
REBALANCE_EVERY = 64  # steps between re-balances of the resident sets (and writes of the stats file)
# Experts a layer swaps in at most per re-balance between steps: the swap copies them in and the leaving ones out
# over PCIe while service waits (43 layers x 2 x 12.8 MiB each for V4-Flash: ~0.1 s); a first run's even split
# reaches the traffic's set over several re-balances instead of one stall of seconds.
REBALANCE_MOVES_PER_LAYER = 2
GIB = 2**30


class ExpertOffload:
    """Every offloaded layer of one model: the arena, the counts, and when to re-balance.

    :meth:`before_step` runs between steps (the model runner calls it before each forward, eager or replayed
    from a graph), never inside a forward: a re-balance reads the counts on the host and rewrites the tables in
    place, which a captured step then reads."""

    def __init__(self, layers: list[LayerResidency], stats: ExpertStats, stats_path: str | None, every: int) -> None:
        self.layers, self.stats, self.stats_path, self.every = layers, stats, stats_path, every
        self.steps = 0
        self._traffic_reader: TrafficReader | None = None

    @property
    def arena(self) -> ExpertArena:
        return self.layers[0].arena

    def before_step(self) -> None:
        """A step is about to run: re-balance when due (no layer is mid-step)."""
        self.steps += 1
        if self.steps % self.every == 0:
            self.rebalance(REBALANCE_MOVES_PER_LAYER)

    def rebalance(self, moves_per_layer: int | None = None) -> int:
        """Make each layer's most-routed experts resident (at most ``moves_per_layer`` moving in a layer; None:
        all) and write the counts; how many experts moved in."""
        self.stats.snapshot()
        moved = sum(layer.rebalance(moves_per_layer) for layer in self.layers)
        if self.stats_path is not None:
            self.stats.save(self.stats_path)
        return moved

    def set_fetch_ahead(self, enabled: bool) -> None:
        """Each offloaded layer fetches the next one's predicted misses (on) or every layer fetches its own."""
        for layer, following in zip(self.layers, self.layers[1:] + [None], strict=True):
            layer.next_layer = following if enabled and following is not None and following.router else None

    def hit_rate(self) -> float:
        """Fraction of expert reads served by resident experts (1.0 before any read)."""
        counts = self.arena.counts()
        return 1.0 if not counts["reads"] else counts["gpu_reads"] / counts["reads"]

    def traffic(self) -> dict[str, int]:
        """Counters since the start: expert reads, of them served by resident experts, host -> device bytes, and
        experts fetched in all and of them ahead of their layer."""
        counts = self.arena.counts()
        return {"reads": counts["reads"], "gpu_reads": counts["gpu_reads"],
                "copied_bytes": counts["fetched"] * self.arena.expert_bytes, "fetched": counts["fetched"],
                "fetched_ahead": counts["fetched_ahead"]}  # fmt: skip

    def poll_traffic(self) -> OffloadTraffic:
        """The counters and the resident / offloaded expert counts for metrics, without waiting for the device
        (:mod:`dsinfer.offload.traffic`: CUDA's numbers lag by at most one call)."""
        if self._traffic_reader is None:
            arena, per_layer = self.arena, self.layers[0].num_experts
            self._traffic_reader = TrafficReader(arena.counters, arena.expert_bytes, arena.layers * arena.resident,
                                                 arena.layers * (per_layer - arena.resident))  # fmt: skip
        return self._traffic_reader.poll()


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
    fetch_ahead: bool | None = None,
    host_keeps_every_expert: bool = HOST_KEEPS_EVERY_EXPERT,
) -> ExpertOffload | None:
    """Keep ``resident_per_layer`` experts of each backbone MoE layer on the model's device, the rest in host
    memory; None when every expert stays resident. ``host_keeps_every_expert`` False: the host store keeps only
    the offloaded experts (a re-balance swaps; :mod:`dsinfer.offload.host_store`); a model with deferred experts
    (``load_model(..., expert_device="meta")``) is read into such a store, and every expert resident into the
    device's stacks.

    Under expert parallelism each rank offloads its own experts (``resident_per_layer`` of them per layer) and
    keeps its counts in its own file (``PATH.rank<r>``); the next layer's router names global experts, so ranks
    fetch each layer's misses as it runs instead of ahead."""
    moes = backbone_moes(model)
    if not moes or any(not moe.is_packed for _, moe in moes):
        raise ConfigError("expert offload needs a loaded model (routed experts stacked in checkpoint form)")
    like = moes[0][1].routed_weights()
    experts = like.num_experts  # the rank's experts per layer
    if not 0 <= resident_per_layer <= experts:
        raise ConfigError(f"resident experts per layer: expected 0..{experts}, got {resident_per_layer}")
    deferred = getattr(model, "deferred_experts", None) is not None
    if deferred and host_keeps_every_expert:
        raise ConfigError("experts read on demand from the checkpoint go to a host store of the offloaded ones only")
    device = model.embed.weight.device
    if resident_per_layer == experts:
        if deferred:
            stream_resident(model, moes, device)
        return None
    parallel = moes[0][1].expert_parallel
    if parallel is not None and stats_path is not None and parallel.ep_size > 1:
        stats_path = f"{stats_path}.rank{parallel.rank}"
    stats = ExpertStats([layer_id for layer_id, _ in moes], experts, device)
    if stats_path is not None:
        stats.load(stats_path)
    arena = ExpertArena(like, len(moes), resident_per_layer, experts - resident_per_layer, device)
    routers = [moe.gate if parallel is None else None for _, moe in moes]
    if deferred:
        layers = stream_offloaded(model, moes, arena, stats, routers)
        return attach_offload(model, layers, stats, stats_path, rebalance_every, fetch_ahead)
    layers = []
    for row, ((_, moe), router) in enumerate(zip(moes, routers, strict=True)):
        weights = moe.routed_weights()
        if host_keeps_every_expert:
            host = HostStore(weights, list(range(experts)), experts, device)
            layers.append(LayerResidency(row, host, arena, stats, moe.ops, router))
            layers[-1].rebalance()
            continue
        wanted = stats.resident(row, resident_per_layer)
        offloaded = [e for e in range(experts) if e not in set(wanted)]
        host = HostStore(_select_experts(weights, offloaded), offloaded, experts, device)
        layers.append(LayerResidency(row, host, arena, stats, moe.ops, router))
        resident_weights = _select_experts(weights, wanted)
        for name in PARTS:
            if getattr(weights, name) is not None:
                slots = getattr(arena.weights, name)[arena.resident_rows(row).start : arena.resident_rows(row).stop]
                slots.copy_(getattr(resident_weights, name))
        layers[-1].place(wanted, filled=True)
    return attach_offload(model, layers, stats, stats_path, rebalance_every, fetch_ahead)


def _select_experts(weights: ExpertWeights, experts: list[int]) -> ExpertWeights:
    """The rows of ``experts`` (a copy, in that order)."""
    index = torch.tensor(experts, dtype=torch.int64, device=weights.w13.device)
    parts = [None if getattr(weights, n) is None else getattr(weights, n).index_select(0, index) for n in PARTS]
    return ExpertWeights(*parts, weights.intermediate_size, weights.is_fp4)


def attach_offload(model, layers: list[LayerResidency], stats: ExpertStats, stats_path, every: int,
                   fetch_ahead: bool | None):  # fmt: skip
    """Hand each backbone MoE layer its residency and the model its :class:`ExpertOffload` (also what a builder
    of random experts in place calls, :mod:`dsinfer.offload.random_experts`). ``fetch_ahead`` None: on where
    few experts are resident (:func:`~dsinfer.config.expert_split.fetch_ahead_by_default`)."""
    offload = ExpertOffload(layers, stats, None if stats_path is None else str(stats_path), every)
    if fetch_ahead is None:
        fetch_ahead = fetch_ahead_by_default(offload.arena.resident, offload.arena.resident + offload.arena.fetch_slots)
    offload.set_fetch_ahead(fetch_ahead)
    for layer, (_, moe) in zip(layers, backbone_moes(model), strict=True):
        moe.expert_residency = layer
    model.expert_offload = offload
    arena = offload.arena
    logger.info("expert offload: %d of %d experts per layer resident in %d layers, the rest in host memory; "
                "fetch-ahead %s", arena.resident, arena.resident + arena.fetch_slots, arena.layers,
                "on" if fetch_ahead else "off")  # fmt: skip
    return offload


def offload_experts(model: torch.nn.Module, config) -> torch.nn.Module:
    """Apply the engine's ``expert_offload`` to a loaded model (its routed experts deferred, or in host memory);
    the model. The budget is sized after every other weight is on the device, before any expert is read.

    A GiB budget gives the routed experts that much of the GPU (resident slots plus fetch buffers). ``auto``
    gives them what the GPU has left after the other weights, the engine's work share and a cache of
    ``max_num_seqs`` full-length sequences; on the CPU (host and device are one memory) everything stays resident.
    """
    deferred = getattr(model, "deferred_experts", None) is not None
    if config.expert_offload is None and not deferred:
        return model
    offload = install_expert_offload(model, resident_per_layer(model, config), config.expert_stats)
    model.expert_offload = offload
    return model


def resident_per_layer(model: torch.nn.Module, config) -> int:
    """Routed experts each backbone MoE layer keeps on the device under the engine's ``expert_offload`` (see
    :func:`offload_experts`; every expert when it is off, or on a CPU under ``auto``)."""
    moes = backbone_moes(model)
    like = moes[0][1].routed_weights()
    experts = like.num_experts
    expert_bytes = like.nbytes // like.num_experts
    if config.expert_offload is None:
        return experts
    if config.expert_offload != "auto":
        return resident_for_budget(float(config.expert_offload), len(moes), experts, expert_bytes)
    if model.embed.weight.device.type != "cuda":
        return experts
    return resident_for_budget(_auto_budget_gib(model, config), len(moes), experts, expert_bytes)


def _auto_budget_gib(model: torch.nn.Module, config) -> float:
    """GiB the routed experts may take on this GPU: free memory less the engine's work share and the cache."""
    from dsinfer.memory_plan import PlanRequest, build_plan

    device = model.embed.weight.device
    free, total = torch.cuda.mem_get_info(device)
    max_model_len = config.resolved_max_model_len(model.config)
    dtype_bytes = model.embed.weight.element_size()
    request = PlanRequest(model.config, max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
                          dtype_bytes=dtype_bytes, block_tokens=config.block_tokens,
                          kv_cache_dtype=config.kv_cache_dtype)  # fmt: skip
    cache = config.max_num_seqs * build_plan(request).per_sequence
    return max(0, free - total * (1 - config.gpu_memory_utilization) - cache) / GIB
