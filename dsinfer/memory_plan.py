"""What goes where before anything is loaded: weights per GPU, routed experts kept in host memory, the Engram
tables, the cache per sequence, and whether ``--max-num-seqs`` sequences of ``--max-model-len`` tokens fit.

``dsinfer plan`` prints it from a config.json alone, and ``dsinfer serve`` prints the same plan at start-up.
The arithmetic follows the engine's own rules, so the numbers are what a load would take:

* every GPU is one rank: attention is data-parallel (each rank holds all of it), the routed experts are split
  evenly over the ranks (expert parallelism);
* the engine's cache gets what ``gpu_memory_utilization`` of the GPU leaves after the weights (the rest is the
  work space), as :func:`dsinfer.engine.cache_plan.cache_blocks_for_budget` sizes it;
* ``max_num_seqs`` is per rank (each rank schedules its own sequences);
* weights: routed experts in checkpoint form (FP4 e2m1 packed two a byte plus one ue8m0 scale per 32 inputs),
  FP8 linears as codes and scales (``keep``) or dequantised to the compute dtype (``dequantize``, CUDA's default);
  every tensor's shape comes from :mod:`dsinfer.config.tensor_shapes`;
* Engram tables (V4.1): placed as ``--engram-placement`` says, else by the engine's rule (host memory when they
  exceed a quarter of the GPU);
* cache per sequence: :mod:`dsinfer.kv.sequence_bytes`, the engine's per-kind accounting.

**Expert offload.** With ``--expert-offload`` (``auto``, or a GPU budget for routed experts in GiB) the routed
experts that do not fit stay in host memory (:mod:`dsinfer.offload`): per layer ``resident`` experts live on the
GPU, and a fetch pool of ``FETCH_BUFFERS`` buffers, each with room for one layer's non-resident experts, takes
the misses of the layer about to run while the one before computes. ``auto`` gives the cache what
``max_num_seqs`` sequences of ``max_model_len`` need and the experts the rest. The host memory counted for the
experts follows the engine's host store: only the offloaded experts by default (``HOST_KEEPS_EVERY_EXPERT``
False: ``--expert-offload`` reads each expert from the checkpoint straight into its GPU slot or host row, and a
re-balance swaps), or every routed expert with ``host_keeps_every_expert=True`` (the store of
:func:`dsinfer.offload.install_expert_offload` with that argument); the printout names which.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from dsinfer.config import ConfigError, ModelConfig, ModelConfigV41, QuantizationConfig
from dsinfer.config.engine import KV_CACHE_DTYPES, check_expert_offload
from dsinfer.config.expert_split import FETCH_BUFFERS, HOST_KEEPS_EVERY_EXPERT, ExpertSplit, largest_split
from dsinfer.config.tensor_shapes import TensorShape, model_tensors
from dsinfer.kv.cache_v4 import block_tokens_for
from dsinfer.kv.cache_v41 import block_tokens_for_v41
from dsinfer.kv.sequence_bytes import (
    KindBytes,
    format_bytes,
    sequence_bytes,
    v4_kind_bytes,
    v4_storages,
    v41_kind_bytes,
    v41_storages,
)

GIB = 2**30
MIB = 2**20
# Memory each GPU reports (nvidia-smi's total, MiB): what ``--gpu-memory h100`` / ``h200`` stand for.
GPU_PRESETS = {"h100": 81559 * MIB, "h200": 143771 * MIB}
FP8_SCALE_CHANNELS = 32  # channels per ue8m0 scale of an Engram row (the store's record)


class PlanError(ValueError):
    """A plan that cannot fit; the message names what is short and by how much."""


def _released_v41() -> ModelConfigV41:
    return ModelConfigV41(engram_layer_ids=(1, 14), quantization=QuantizationConfig(weight_block_size=(32, 32)))


# Release shapes the plan knows by name, so a machine can be planned before any checkpoint is downloaded.
KNOWN_MODELS = {
    "deepseek-v4-flash": lambda: ModelConfig(quantization=QuantizationConfig()),
    "deepseek-v4.1-flash": _released_v41,
}
RELEASE_LABELS = {"deepseek-v4-flash": "DeepSeek-V4-Flash", "deepseek-v4.1-flash": "DeepSeek-V4.1-Flash"}


def plan_config(model: str | Path) -> tuple[ModelConfig | ModelConfigV41, str]:
    """The config ``model`` names (a checkpoint directory, a config.json, or a release name) and its label."""
    text = str(model)
    key = text.lower().removeprefix("deepseek-ai/")
    key = key if key.startswith("deepseek-") else f"deepseek-{key}"
    key = key.replace("v41", "v4.1")
    if key in KNOWN_MODELS and not Path(text).exists():
        return KNOWN_MODELS[key](), RELEASE_LABELS[key]
    path = Path(text).expanduser()
    if not path.exists():
        names = ", ".join(KNOWN_MODELS)
        raise ConfigError(f"model {text!r}: not a checkpoint directory or config.json, nor a release name ({names})")
    return ModelConfig.from_file(path), (path.parent if path.is_file() else path).name


def gpu_memory_bytes(value: str) -> tuple[int, str]:
    """``--gpu-memory``: ``h100`` / ``h200`` or a number of GiB; the bytes and a label."""
    preset = GPU_PRESETS.get(value.strip().lower())
    if preset is not None:
        return preset, value.strip().upper()
    try:
        gib = float(value)
    except ValueError:
        raise ConfigError(
            f"--gpu-memory: expected {' or '.join(GPU_PRESETS)} or a number of GiB, got {value!r}"
        ) from None
    if not 0 < gib < math.inf:
        raise ConfigError(f"--gpu-memory: must be a positive number of GiB, got {value!r}")
    return int(gib * GIB), f"{gib:g} GiB GPU"


def this_host_memory() -> int:
    """Physical memory of this machine (the default ``--host-memory``)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class PlanRequest:
    """Everything a plan depends on: the model, the machine, the engine's sizes and the offload choice."""

    config: ModelConfig | ModelConfigV41
    gpus: int = 1
    gpu_memory: int = GPU_PRESETS["h200"]
    host_memory: int | None = None  # None: this machine's
    max_model_len: int | None = None  # None: the engine's default, min(model's positions, 16384)
    max_num_seqs: int = 16
    expert_offload: str | float | None = None  # None: off; "auto"; or a GPU budget for routed experts in GiB
    host_keeps_every_expert: bool = HOST_KEEPS_EVERY_EXPERT  # the host store: every expert, or the offloaded ones
    kv_cache_dtype: str = "auto"
    dtype_bytes: int = 2
    fp8_linears: str = "dequantize"
    gpu_memory_utilization: float = 0.9
    engram_placement: str | None = None
    with_drafter: bool = False
    block_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus <= 0:
            raise ConfigError(f"--gpus: expected a positive integer, got {self.gpus!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        check_expert_offload(self.expert_offload, "--expert-offload")

    @property
    def context(self) -> int:
        if self.max_model_len is None:
            return min(self.config.max_position_embeddings, 16384)
        return self.max_model_len


@dataclass(frozen=True)
class WeightBytes:
    """One replica's weights by part (before the experts are split over ranks), and one routed expert's bytes."""

    ends: int  # embedding, head, final norm (and V4's hc_head)
    attention: int  # per layer: attention with its compressor and indexer, mHC, norms, Engram projections
    dense_ffn: int  # per layer: the router and the shared expert
    drafter: int  # MTP layers / DSpark stages, their own experts included (with speculative decoding)
    expert: int  # one routed expert in checkpoint form
    moe_layers: int
    experts_per_layer: int
    engram_store: int  # the Engram tables as the host store keeps them (FP8 rows, ue8m0 bytes)
    engram_device: int  # the Engram tables as the model's buffers keep them (FP8 rows, float32 scales)

    @property
    def routed(self) -> int:
        return self.moe_layers * self.experts_per_layer * self.expert


def tensor_bytes(tensor: TensorShape, request: PlanRequest) -> int:
    """Bytes of ``tensor`` on the device under the request's dtype and FP8 policy (Engram tables: see below)."""
    quantization, numel = request.config.quantization, tensor.numel
    if tensor.storage == "fp4":
        if quantization is None or quantization.expert_dtype != "fp4":
            return numel * request.dtype_bytes
        return numel // 2 + numel // quantization.fp4_group_size
    if tensor.storage == "fp8":
        if quantization is None or request.fp8_linears == "dequantize":
            return numel * request.dtype_bytes
        rows, cols = quantization.weight_block_size
        return numel + math.ceil(tensor.shape[0] / rows) * math.ceil(tensor.shape[1] / cols)
    if tensor.storage in ("fp32", "int32"):
        return numel * 4
    if tensor.storage == "engram":
        return numel + numel // FP8_SCALE_CHANNELS * 4
    return numel * request.dtype_bytes


def weight_bytes(request: PlanRequest) -> WeightBytes:
    """Sum :func:`~dsinfer.config.tensor_shapes.model_tensors` by part."""
    parts = dict.fromkeys(("ends", "attention", "dense_ffn", "drafter"), 0)
    expert, moe_layers, engram_store, engram_device = 0, 0, 0, 0
    for tensor in model_tensors(request.config, request.with_drafter):
        size = tensor_bytes(tensor, request)
        if tensor.name.startswith("mtp."):
            parts["drafter"] += size
        elif tensor.storage == "engram":
            engram_device += size
            engram_store += tensor.numel + tensor.numel // FP8_SCALE_CHANNELS
        elif tensor.storage == "fp4":
            expert, moe_layers = size // tensor.shape[0], moe_layers + 1
        elif not tensor.name.startswith("layers."):
            parts["ends"] += size
        else:
            parts["dense_ffn" if ".ffn." in tensor.name else "attention"] += size
    experts = request.config.n_routed_experts
    return WeightBytes(**parts, expert=expert, moe_layers=moe_layers, experts_per_layer=experts,
                       engram_store=engram_store, engram_device=engram_device)  # fmt: skip


def cache_kinds(request: PlanRequest) -> tuple[list[KindBytes], str]:
    """One sequence's cache at the request's context, per layer kind, and the storage's name."""
    config, tokens = request.config, request.context
    if config.family == "v41":
        storages, engine_default = v41_storages(), "fp8"  # the release's trained-in rounding: codes and scales
        block = block_tokens_for_v41(config, request.block_tokens)
        name = engine_default if request.kv_cache_dtype == "auto" else request.kv_cache_dtype
        storage = replace(storages[name], element_bytes=request.dtype_bytes)
        drafters = config.num_nextn_predict_layers if request.with_drafter else 0
        return v41_kind_bytes(config, tokens, block, storage, drafters), name
    block = block_tokens_for(config, request.block_tokens)
    name = "bf16" if request.kv_cache_dtype == "auto" else request.kv_cache_dtype
    storage = replace(v4_storages()[name], element_bytes=request.dtype_bytes)
    drafters = config.num_nextn_predict_layers if request.with_drafter else 0
    return v4_kind_bytes(config, tokens, block, storage, drafters), name


def engram_placement(request: PlanRequest, weights: WeightBytes) -> str | None:
    """Where the Engram tables go: as requested, else host memory when they exceed a quarter of the GPU (the
    engine's default, :func:`dsinfer.engram.fetch.resolve_placement`); None without Engram."""
    if not weights.engram_store:
        return None
    if request.engram_placement is not None:
        return request.engram_placement
    return "host" if weights.engram_store > request.gpu_memory // 4 else "device"


def split_experts(weights: WeightBytes, ranks: int, budget: int | None) -> ExpertSplit | None:
    """One rank's split of the routed experts under ``budget`` bytes (None: all resident)."""
    per_layer = math.ceil(weights.experts_per_layer / ranks)
    if budget is None:
        return ExpertSplit(per_layer, per_layer, weights.moe_layers, weights.expert)
    return largest_split(per_layer, weights.moe_layers, weights.expert, budget)


@dataclass(frozen=True)
class MemoryPlan:
    """A request's placement: every number the printout shows, and what (if anything) does not fit."""

    request: PlanRequest
    model_label: str
    gpu_label: str
    weights: WeightBytes
    experts: ExpertSplit
    engram: str | None
    cache: list[KindBytes]
    cache_storage: str
    expert_budget_short: int = 0  # bytes the fetch pool alone lacks under a GiB expert budget

    @property
    def usable(self) -> int:
        return int(self.request.gpu_memory * self.request.gpu_memory_utilization)

    @property
    def engram_gpu_bytes(self) -> int:
        device = self.weights.engram_device
        return {"device": device, "sharded": math.ceil(device / self.request.gpus)}.get(self.engram or "", 0)

    @property
    def fixed_gpu_bytes(self) -> int:
        """Weights every rank holds whatever the expert split: all but the routed experts."""
        w = self.weights
        return w.ends + w.attention + w.dense_ffn + w.drafter + self.engram_gpu_bytes

    @property
    def gpu_weight_bytes(self) -> int:
        return self.fixed_gpu_bytes + self.experts.gpu_bytes

    @property
    def cache_budget(self) -> int:
        return self.usable - self.gpu_weight_bytes

    @property
    def per_sequence(self) -> int:
        return sequence_bytes(self.cache)

    @property
    def sequences_per_gpu(self) -> int:
        return max(0, self.cache_budget // max(self.per_sequence, 1))

    @property
    def expert_host_bytes(self) -> int:
        """One rank's host store of routed experts: every expert, or only the offloaded ones, as requested."""
        experts = self.experts
        return experts.host_bytes if self.request.host_keeps_every_expert else experts.offloaded_host_bytes

    @property
    def host_bytes(self) -> int:
        engram = self.weights.engram_store if self.engram == "host" else 0
        return self.expert_host_bytes * self.request.gpus + engram

    @property
    def host_memory(self) -> int:
        return self.request.host_memory if self.request.host_memory is not None else this_host_memory()

    def shortfalls(self) -> list[str]:
        """One sentence per resource that is short, naming by how much; empty when the plan fits."""
        request, short = self.request, []
        if self.expert_budget_short:
            short.append(f"--expert-offload {request.expert_offload} GiB cannot hold even the fetch pool "
                         f"({format_bytes(self.experts.gpu_bytes)}); raise it")  # fmt: skip
        need = request.max_num_seqs * self.per_sequence
        if self.cache_budget < need:
            short.append(
                f"each GPU is short by {format_bytes(need - self.cache_budget)}: {format_bytes(self.usable)} usable "
                f"({request.gpu_memory_utilization:.0%} of {format_bytes(request.gpu_memory)}) holds "
                f"{format_bytes(self.gpu_weight_bytes)} of weights, leaving {format_bytes(max(self.cache_budget, 0))} "
                f"for a cache of {request.max_num_seqs} sequences x {format_bytes(self.per_sequence)} "
                f"({format_bytes(need)}){self._advice()}"
            )
        if self.host_bytes > self.host_memory:
            short.append(f"host memory is short by {format_bytes(self.host_bytes - self.host_memory)}: "
                         f"{format_bytes(self.host_bytes)} needed, {format_bytes(self.host_memory)} there")  # fmt: skip
        return short

    def _advice(self) -> str:
        if self.request.expert_offload is None and self.experts.per_layer:
            return "; --expert-offload auto keeps what does not fit in host memory, or use more --gpus"
        return "; lower --max-num-seqs or --max-model-len, or use more --gpus"

    def check(self) -> None:
        """Raise :class:`PlanError` naming every shortfall, if any."""
        short = self.shortfalls()
        if short:
            raise PlanError(
                f"{self.model_label} does not fit {self.request.gpus} x {self.gpu_label}: " + "; ".join(short)
            )


def build_plan(request: PlanRequest, model_label: str = "the model", gpu_label: str = "GPU") -> MemoryPlan:
    """Place the request's model (no check: :meth:`MemoryPlan.check` says whether it fits)."""
    weights = weight_bytes(request)
    cache, storage = cache_kinds(request)
    plan = MemoryPlan(request, model_label, gpu_label, weights, split_experts(weights, request.gpus, None),
                      engram_placement(request, weights), cache, storage)  # fmt: skip
    offload = request.expert_offload
    if offload is None or offload == "auto" and plan.cache_budget >= request.max_num_seqs * plan.per_sequence:
        return plan
    if offload == "auto":
        budget = plan.usable - plan.fixed_gpu_bytes - request.max_num_seqs * plan.per_sequence
    else:
        budget = int(float(offload) * GIB)
    split = split_experts(weights, request.gpus, budget)
    if split is None:  # not even the fetch pool fits: keep nothing resident and say so
        split = replace(plan.experts, resident=0)
        short = 0 if offload == "auto" else split.gpu_bytes - budget
        return replace(plan, experts=split, expert_budget_short=short)
    return replace(plan, experts=split)


def plan_lines(plan: MemoryPlan) -> list[str]:
    """The printout: what each GPU holds, what the host holds, the cache per sequence, the verdict."""
    request, weights, experts = plan.request, plan.weights, plan.experts
    fp8 = "kept as FP8" if request.fp8_linears == "keep" else f"dequantised to {8 * request.dtype_bytes}-bit"
    lines = [
        f"plan: {plan.model_label} on {request.gpus} x {plan.gpu_label} ({format_bytes(request.gpu_memory)} each, "
        f"{format_bytes(plan.usable)} usable at {request.gpu_memory_utilization:.0%})",
        f"weights per GPU (compute dtype {8 * request.dtype_bytes}-bit, FP8 linears {fp8}):",
        f"  {'embedding, head, final norm':<44}{format_bytes(weights.ends):>12}",
        f"  {f'attention, mHC, norms ({weights.moe_layers} layers)':<44}{format_bytes(weights.attention):>12}",
        f"  {'routers and shared experts':<44}{format_bytes(weights.dense_ffn):>12}",
    ]
    if weights.drafter:
        lines.append(f"  {'drafter (MTP / DSpark)':<44}{format_bytes(weights.drafter):>12}")
    if plan.engram_gpu_bytes:
        lines.append(f"  {f'Engram tables ({plan.engram})':<44}{format_bytes(plan.engram_gpu_bytes):>12}")
    resident = f"routed experts: {experts.resident} of {experts.per_layer} per layer x {experts.layers}"
    lines.append(f"  {resident:<44}{format_bytes(experts.layers * experts.resident * experts.expert):>12}"
                 f"  ({format_bytes(experts.expert)} each: packed FP4 + scales)")  # fmt: skip
    if experts.offloaded:
        pool = f"expert fetch pool: {FETCH_BUFFERS} x {experts.offloaded} slots"
        lines.append(f"  {pool:<44}{format_bytes(experts.fetch_slots * experts.expert):>12}")
    lines.append(f"  {'total':<44}{format_bytes(plan.gpu_weight_bytes):>12}")
    lines += _host_lines(plan)
    lines.append(f"cache per sequence at {request.context:,} tokens ({plan.cache_storage} storage), per layer kind:")
    lines += [f"  {kind.kind:<34}{kind.layers:>4} x {format_bytes(kind.per_layer):>10}" for kind in plan.cache]
    lines.append(f"  {'per sequence':<44}{format_bytes(plan.per_sequence):>12}")
    fit = plan.sequences_per_gpu
    cache = format_bytes(max(plan.cache_budget, 0))
    lines.append(f"sequences: {request.max_num_seqs} per GPU asked, {fit} fit per GPU in {cache} of cache "
                 f"({fit * request.gpus} over {request.gpus} GPUs)")  # fmt: skip
    short = plan.shortfalls()
    lines.append("verdict: fits" if not short else "verdict: does not fit: " + "; ".join(short))
    return lines


def _host_lines(plan: MemoryPlan) -> list[str]:
    experts, lines = plan.experts, []
    source = "--host-memory" if plan.request.host_memory is not None else "this machine"
    lines.append(f"host memory ({format_bytes(plan.host_memory)}, {source}):")
    if experts.offloaded:
        kept = "every expert" if plan.request.host_keeps_every_expert else "offloaded only"
        lines.append(f"  {f'routed experts ({kept}, checkpoint form)':<44}"
                     f"{format_bytes(plan.expert_host_bytes * plan.request.gpus):>12}"
                     f"  ({experts.offloaded} of {experts.per_layer} per layer fetched on use)")  # fmt: skip
    if plan.engram == "host":
        lines.append(f"  {'Engram tables (one copy per host)':<44}{format_bytes(plan.weights.engram_store):>12}")
    if len(lines) == 1:
        lines.append("  nothing (every weight is on the GPUs)")
    return lines
