"""Load a DeepSeek-V4 or V4.1 checkpoint directory: config.json, safetensors shards, FP8 / FP4 weights.

Shards are memory-mapped and each is opened once. Every tensor is matched to a parameter of the model by
name (official or Hugging Face spelling), checked for shape, dequantised if stored as FP8 (block scales)
or FP4 (packed e2m1, per-32 scales), and copied into place. Anything that does not fit gives one
:class:`CheckpointError` naming the tensor or file.

V4.1's Engram tables go where ``engram_placement`` says (:mod:`dsinfer.engram.placement`): into the model
like any weight (``device``), or, for ``host`` and ``sharded``, not into the model at all: they are read
from the shards into a shared-memory segment and the model gets the placement's fetcher, which it owns.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from dsinfer.config import ConfigError, ModelConfig, ModelConfigV41
from dsinfer.engram.hashing import EngramHasher
from dsinfer.engram.placement import TABLES_OUTSIDE_MODEL, check_placement, choose_placement, open_engram_tables
from dsinfer.models.deepseek_v4 import DeepseekV4, RopeTables
from dsinfer.models.deepseek_v41 import DeepseekV41
from dsinfer.models.deferred_experts import DeferredExperts
from dsinfer.models.expert_packing import ROUTED_EXPERT, ExpertCollector, ExpertPackingError
from dsinfer.models.fp8_linears import Fp8LinearCollector, resolve_fp8_linears
from dsinfer.models.hf_names import FUSED_EXPERTS, strip_model_prefix, to_hf_name, v41_name
from dsinfer.ops.quant import dequantize_fp4, dequantize_fp8_blockwise
from dsinfer.ops.registry import resolve
from dsinfer.tokenizer import Tokenizer, TokenizerLoadError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FP8_DTYPES = (torch.float8_e4m3fn,)
FP4_DTYPES = (torch.int8, torch.uint8)
FP4_STORED = ("I8", "U8")  # the same, as a shard's header spells them
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
# Parameters kept in float32 whatever the compute dtype (as DeepSeek and Hugging Face keep them).
_FP32_PARAMETER = re.compile(
    r"(hc_|attn_sink|\.ape$|norm\.weight$|gate\.bias(_vl)?$|engram\.embed\.scale$|^vision\..*norm\d\.weight$)"
)
# Kept in their stored FP8 form and dequantised on use (the V4.1 Engram tables, ~100 GB each when released).
_KEEP_STORED = re.compile(r"engram\.embed\.weight$")
# The Engram tables: left out of the model when they live outside it (host / sharded placement).
_ENGRAM_TABLE = re.compile(r"engram\.embed\.(weight|scale)$")
# V4.1 tensors a checkpoint may leave out, filled with zeros: DSpark routers' image-token bias.
_OPTIONAL_ZEROS = re.compile(r"^mtp\.\d+\.ffn\.gate\.bias_vl$")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the tensor or file."""


def shard_files(directory: Path) -> list[Path]:
    """The safetensors shards of a checkpoint, in index order; checks that every listed shard exists."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from None
        names = list(dict.fromkeys(weight_map.values()))
        for name in names:
            if not (directory / name).is_file():
                raise CheckpointError(f"{directory / name}: shard listed in {INDEX_FILE} is missing")
        return [directory / name for name in names]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    if len(found) > 1 or found[0].name != SINGLE_FILE:
        raise CheckpointError(f"{index}: missing index file for the {len(found)} shard(s) in {directory}")
    return found


@dataclass
class _Stored:
    """One tensor as it sits in a shard (not yet read)."""

    shard: Path
    key: str
    shape: tuple[int, ...]
    dtype: str


def _scan_shards(shards: list[Path]) -> dict[str, _Stored]:
    """Read only the headers: which tensors exist, where, with which shape and dtype."""
    stored: dict[str, _Stored] = {}
    for shard in shards:
        try:
            with safe_open(shard, "pt") as handle:
                for key in handle.keys():
                    view = handle.get_slice(key)
                    stored[key] = _Stored(shard, key, tuple(view.get_shape()), view.get_dtype())
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{shard}: unreadable or truncated safetensors shard ({exc})") from None
        _check_length(shard)
    return stored


def _check_length(shard: Path) -> None:
    """safetensors maps lazily; compare the header's data size with the file size to catch truncation."""
    with open(shard, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        header = json.loads(handle.read(header_len))
    end = max((entry["data_offsets"][1] for k, entry in header.items() if k != "__metadata__"), default=0)
    actual = shard.stat().st_size - 8 - header_len
    if actual < end:
        raise CheckpointError(f"{shard}: truncated shard ({actual} data bytes, header needs {end})")


def _plan(model: DeepseekV4 | DeepseekV41, stored: dict[str, _Stored]) -> dict[str, list[str]]:
    """Map each model parameter to the stored key(s) that fill it; report unexpected names."""
    targets = dict(model.state_dict())
    name_key = v41_name if isinstance(model, DeepseekV41) else to_hf_name
    by_hf_name = {name_key(name): name for name in targets}
    plan: dict[str, list[str]] = {}
    for key in stored:
        bare = strip_model_prefix(key)
        if _is_weight_scale(key, stored) and name_key(bare) not in by_hf_name:
            continue
        fused = FUSED_EXPERTS.match(to_hf_name(bare)) if name_key is to_hf_name else None
        if fused:
            layer, which = fused.groups()
            plan.setdefault(f"fused:{layer}:{which}", []).append(key)
            continue
        name = bare if bare in targets else by_hf_name.get(name_key(bare))
        if name is None:
            raise CheckpointError(
                f"unexpected tensor {key!r} in {stored[key].shard.name}: the model has no such weight"
            )
        plan.setdefault(name, []).append(key)
    return plan


def _is_weight_scale(key: str, stored: dict[str, _Stored]) -> bool:
    """A ``.scale`` tensor belongs to a quantised ``.weight`` sibling (``hc_head.hc_scale`` does not)."""
    for suffix in SCALE_SUFFIXES:
        if key.endswith(suffix) and key[: -len(suffix)] + ".weight" in stored:
            return True
    return False


def _scale_key(key: str, stored: dict[str, _Stored]) -> str | None:
    base = key[: -len(".weight")] if key.endswith(".weight") else key
    for suffix in SCALE_SUFFIXES:
        if base + suffix in stored:
            return base + suffix
    return None


class _ShardReader:
    """Keeps each shard open once while tensors are read from it."""

    def __init__(self) -> None:
        self.handles: dict[Path, object] = {}

    def get(self, item: _Stored) -> torch.Tensor:
        handle = self.handles.get(item.shard)
        if handle is None:
            handle = self.handles[item.shard] = safe_open(item.shard, "pt")
        try:
            return handle.get_tensor(item.key)
        except SafetensorError as exc:
            raise CheckpointError(f"{item.shard}: cannot read tensor {item.key!r} ({exc})") from None

    def get_row(self, item: _Stored, index: int) -> torch.Tensor:
        """Entry ``index`` of the tensor's first dimension, reading only its bytes."""
        handle = self.handles.get(item.shard)
        if handle is None:
            handle = self.handles[item.shard] = safe_open(item.shard, "pt")
        try:
            return handle.get_slice(item.key)[index]
        except SafetensorError as exc:
            raise CheckpointError(f"{item.shard}: cannot read tensor {item.key!r} ({exc})") from None


class _DeferredReader:
    """Reads deferred routed experts (:mod:`dsinfer.models.deferred_experts`) with the loader's checks and
    dequantisation, after the rest of the model has loaded."""

    def __init__(self, stored: dict[str, _Stored], config: ModelConfig | ModelConfigV41, dtype: torch.dtype) -> None:
        self.stored, self.config, self.dtype = stored, config, dtype
        self.reader = _ShardReader()

    def part(self, key: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        target = torch.empty(shape, device="meta")
        return _read_expert(key, target, self.stored, self.reader, self.config, self.dtype)

    def row(self, key: str, index: int) -> torch.Tensor:
        return self.reader.get_row(self.stored[key], index).to(self.dtype)

    def close(self) -> None:
        self.reader.handles.clear()


def _materialise(
    key: str,
    target: torch.Tensor,
    stored: dict[str, _Stored],
    reader: _ShardReader,
    config: ModelConfig | ModelConfigV41,
) -> torch.Tensor:
    """Read one stored tensor and bring it to the target's shape and dtype (dequantising on the way)."""
    item = stored[key]
    raw = reader.get(item)
    scale_key = _scale_key(key, stored)
    want = tuple(target.shape)
    if _KEEP_STORED.search(key):
        if tuple(raw.shape) != want:
            raise CheckpointError(f"tensor {key!r}: shape {tuple(raw.shape)}, expected {want}")
        return raw
    if raw.dtype in FP8_DTYPES:
        if scale_key is None:
            raise CheckpointError(f"tensor {key!r}: FP8 weight without a .scale tensor")
        block = _fp8_block(config)
        scale = reader.get(stored[scale_key])
        _check_fp8_shapes(key, raw, scale, want, block)
        return dequantize_fp8_blockwise(raw, scale, block, dtype=torch.float32)
    if raw.dtype in FP4_DTYPES and target.is_floating_point():
        if scale_key is None:
            raise CheckpointError(f"tensor {key!r}: packed FP4 weight without a .scale tensor")
        scale = reader.get(stored[scale_key])
        _check_fp4_shapes(key, raw, scale, want, config)
        group = config.quantization.fp4_group_size if config.quantization else 32
        return dequantize_fp4(raw, scale, group, dtype=torch.float32)
    if tuple(raw.shape) != want:
        raise CheckpointError(f"tensor {key!r}: shape {tuple(raw.shape)}, expected {want}")
    return raw


def _fp8_block(config: ModelConfig | ModelConfigV41) -> tuple[int, int]:
    return tuple(config.quantization.weight_block_size) if config.quantization else (128, 128)


def _check_fp8_shapes(key: str, raw: torch.Tensor, scale: torch.Tensor, want: tuple, block: tuple[int, int]) -> None:
    expected_scale = (math.ceil(want[0] / block[0]), math.ceil(want[1] / block[1]))
    if tuple(raw.shape) != want or tuple(scale.shape) != expected_scale:
        raise CheckpointError(
            f"tensor {key!r}: FP8 weight {tuple(raw.shape)} with scale {tuple(scale.shape)}, "
            f"expected {want} with scale {expected_scale}"
        )


def _read_expert(
    key: str,
    target: torch.Tensor,
    stored: dict[str, _Stored],
    reader: _ShardReader,
    config: ModelConfig | ModelConfigV41,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One routed expert weight as it will be served: packed FP4 bytes with their scale, else floats in ``dtype``."""
    raw = reader.get(stored[key])
    scale_key = _scale_key(key, stored)
    if raw.dtype in FP4_DTYPES and scale_key is not None:
        scale = reader.get(stored[scale_key])
        _check_fp4_shapes(key, raw, scale, tuple(target.shape), config)
        return raw, scale
    return _materialise(key, target, stored, reader, config).to(dtype), None


def _check_fp4_shapes(key: str, raw: torch.Tensor, scale: torch.Tensor, want: tuple[int, ...], config) -> None:
    group = config.quantization.fp4_group_size if config.quantization else 32
    if len(want) != 2:
        raise CheckpointError(f"tensor {key!r}: a packed FP4 weight must be 2-D, the model expects {want}")
    expected, expected_scale = (want[0], want[1] // 2), (want[0], want[1] // group)
    if tuple(raw.shape) != expected or tuple(scale.shape) != expected_scale:
        raise CheckpointError(
            f"tensor {key!r}: FP4 weight {tuple(raw.shape)} with scale {tuple(scale.shape)}, "
            f"expected {expected} with scale {expected_scale}"
        )


def _fused_expert_tensors(
    kind: str, layer: str, fused: torch.Tensor, model_keys: set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Split Hugging Face's stacked ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I] per expert."""
    for expert in range(fused.shape[0]):
        prefix = f"layers.{layer}.ffn.experts.{expert}"
        if kind == "gate_up_proj":
            gate, up = fused[expert].chunk(2, dim=0)
            yield f"{prefix}.w1.weight", gate
            yield f"{prefix}.w3.weight", up
        else:
            yield f"{prefix}.w2.weight", fused[expert]
    if f"layers.{layer}.ffn.experts.{fused.shape[0]}.w1.weight" in model_keys:
        raise CheckpointError(f"tensor 'layers.{layer}.mlp.experts.{kind}': holds {fused.shape[0]} experts, too few")


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = True,
    engram_placement: str | None = None,
    fp8_linears: str | None = None,
    owned_experts=None,
    expert_device: str | torch.device | None = None,
) -> DeepseekV4 | DeepseekV41:
    """Build the model described by ``path/config.json`` (V4 or V4.1) and fill it from the checkpoint's shards.

    ``engram_placement`` (``device``, ``host``, ``sharded``; None: ``$DSINFER_ENGRAM_PLACEMENT``, else the
    default of :func:`dsinfer.engram.fetch.resolve_placement`) says where V4.1's Engram tables live. A
    model without Engram layers (every V4 checkpoint) ignores it. With ``host`` or ``sharded`` the returned
    model owns a shared-memory segment or a table shard: call its ``close()`` when done.

    ``fp8_linears`` (``keep``, ``dequantize``; None: ``$DSINFER_FP8_LINEARS``, else the device's default in
    :mod:`dsinfer.models.fp8_linears`: dequantize on CUDA, keep elsewhere) says whether the block-scaled FP8
    linears stay FP8 or become the compute dtype; routed experts always stay as stored.

    ``owned_experts(moe_path)`` (an EP rank, :func:`dsinfer.parallel.ep.backbone_expert_filter`): the routed
    experts of that layer to load, in stacking order, or None for all; the rest are never read.

    ``expert_device``: where the stacked routed experts go (None: ``device``); ``"cpu"`` keeps them in host memory
    for :func:`dsinfer.offload.install_expert_offload`, read from the shards without passing through the GPU.
    ``"meta"`` reads none of the backbone layers' experts: they stay shapes only, and ``model.deferred_experts``
    (:mod:`dsinfer.models.deferred_experts`) says where each is stored, for the expert offload to read each one
    once straight into its GPU slot or host row (the drafter's experts load onto ``device``).
    """
    directory = Path(path)
    try:
        config = ModelConfig.from_file(directory)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    has_engram = isinstance(config, ModelConfigV41) and bool(config.engram_layer_ids)
    placement = choose_placement(config, engram_placement, device) if has_engram else None
    check_placement(placement)  # before the shards are read: 'sharded' needs a process group
    stored = _scan_shards(shard_files(directory))
    has_mtp = any(strip_model_prefix(k).startswith("mtp.") for k in stored)
    model_class = DeepseekV41 if isinstance(config, ModelConfigV41) else DeepseekV4
    ops = resolve(device, dtype)  # once, for the device and dtype the model runs on
    with torch.device("meta"):
        model = model_class(config, with_mtp=has_mtp, ops=ops)
    plan = _plan(model, stored)
    if placement in TABLES_OUTSIDE_MODEL:  # read into shared memory below, never into the model
        model.drop_engram_tables()
        plan = {name: keys for name, keys in plan.items() if not _ENGRAM_TABLE.search(name)}
    deferring = expert_device is not None and torch.device(expert_device).type == "meta"
    deferred = DeferredExperts(_DeferredReader(stored, config, dtype), dtype) if deferring else None
    experts = ExpertCollector(owned_experts, deferred)  # routed experts stay in checkpoint precision, stacked
    fp8 = Fp8LinearCollector(resolve_fp8_linears(fp8_linears, device), _fp8_block(config), dtype, stored)
    values = _read_checkpoint(directory, model, plan, stored, experts, fp8, dtype, progress)
    stacked_on = device if expert_device is None or deferring else expert_device
    _fill(model, values, experts, fp8, (device, stacked_on), dtype, directory)
    if deferred is not None:
        model.deferred_experts = deferred
    model.rope = RopeTables(config).to(device)
    model.join_projections()
    if has_engram:
        model.attach_engram_hasher(engram_hasher_for(directory, config))
        if placement in TABLES_OUTSIDE_MODEL:
            model.attach_engram_fetcher(open_engram_tables(directory, config, placement, device=device, dtype=dtype))
    return model.requires_grad_(False).eval()


def _read_checkpoint(
    directory: Path,
    model: DeepseekV4 | DeepseekV41,
    plan: dict[str, list[str]],
    stored: dict[str, _Stored],
    experts: ExpertCollector,
    fp8: Fp8LinearCollector,
    dtype: torch.dtype,
    progress: bool,
) -> dict[str, torch.Tensor]:
    """Read every planned tensor once: routed experts go to ``experts``, kept FP8 linears to ``fp8``, the rest come
    back by name (zeros for the optional tensors the checkpoint lacks). Raises naming the tensors missing."""
    config = model.config
    targets = model.state_dict()
    reader = _ShardReader()
    values: dict[str, torch.Tensor] = {}
    model_keys = set(targets)
    bar = tqdm(total=len(plan), desc=f"Loading {directory.name}", unit="tensor", disable=not progress)
    for name, keys in plan.items():
        if name.startswith("fused:"):
            _, layer, kind = name.split(":")
            if experts.defers(f"layers.{layer}.ffn.experts.0.w1.weight"):
                _defer_fused(model, experts, f"layers.{layer}.ffn", kind, stored[keys[0]])
                bar.update(1)
                continue
            fused = reader.get(stored[keys[0]])
            for expert_name, tensor in _fused_expert_tensors(kind, layer, fused, model_keys):
                if expert_name not in targets or tuple(tensor.shape) != tuple(targets[expert_name].shape):
                    raise CheckpointError(
                        f"tensor {keys[0]!r}: shape {tuple(fused.shape)} does not match the config's experts"
                    )
                experts.take(expert_name, tensor.to(dtype), None)
        else:
            if len(keys) > 1:
                raise CheckpointError(f"tensor {name!r} is stored twice: {keys}")
            if experts.is_routed_expert(name):
                if not experts.wants(name):  # another EP rank's expert
                    bar.update(1)
                    continue
                if experts.defers(name):  # read later, straight to where the expert offload puts it
                    _defer_expert(model, experts, name, keys[0], stored)
                    bar.update(1)
                    continue
                experts.take(name, *_read_expert(keys[0], targets[name], stored, reader, config, dtype))
            elif fp8.wants(name, stored[keys[0]], targets[name]):
                codes, scale = reader.get(stored[keys[0]]), reader.get(stored[_scale_key(keys[0], stored)])
                _check_fp8_shapes(keys[0], codes, scale, tuple(targets[name].shape), _fp8_block(config))
                fp8.take(name, codes, scale)
            else:
                values[name] = _materialise(keys[0], targets[name], stored, reader, config)
        bar.update(1)
    bar.close()
    for name in targets:
        if name not in values and _OPTIONAL_ZEROS.search(name):
            values[name] = torch.zeros(targets[name].shape, dtype=torch.float32)
    collected = experts.collected_names() | fp8.collected_names()
    missing = [name for name in targets if name not in values and name not in collected]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{directory}: missing tensor(s) {shown}{more}")
    return values


def _defer_expert(model, experts: ExpertCollector, name: str, key: str, stored: dict[str, _Stored]) -> None:
    """Check a deferred expert weight's stored shape from the shard's header and record where it is."""
    moe = ROUTED_EXPERT.match(name)["moe"]
    want = tuple(model.get_parameter(name).shape)
    item, scale_key = stored[key], _scale_key(key, stored)
    fp4 = item.dtype in FP4_STORED and scale_key is not None
    if fp4:
        shapes = (torch.empty(item.shape, device="meta"), torch.empty(stored[scale_key].shape, device="meta"))
        _check_fp4_shapes(key, *shapes, want, model.config)
    elif item.shape != want:
        raise CheckpointError(f"tensor {key!r}: shape {item.shape}, expected {want}")
    order = experts.stacking_order(moe, model.get_submodule(moe).n_experts)
    experts.deferred.record(name, key, fp4, order, tuple(model.get_parameter(f"{moe}.experts.0.w1.weight").shape))


def _defer_fused(model, experts: ExpertCollector, moe: str, kind: str, item: _Stored) -> None:
    """Check Hugging Face's stacked ``gate_up_proj`` / ``down_proj`` of a deferred layer and record it."""
    inter, hidden = model.get_parameter(f"{moe}.experts.0.w1.weight").shape
    count = model.get_submodule(moe).n_experts
    want = (count, 2 * inter, hidden) if kind == "gate_up_proj" else (count, hidden, inter)
    if item.shape != want:
        raise CheckpointError(f"tensor {item.key!r}: shape {item.shape} does not match the config's experts {want}")
    experts.deferred.record_fused(moe, kind, item.key, experts.stacking_order(moe, count), (inter, hidden))


def _fill(
    model: DeepseekV4 | DeepseekV41,
    values: dict[str, torch.Tensor],
    experts: ExpertCollector,
    fp8: Fp8LinearCollector,
    devices: tuple[str | torch.device, str | torch.device],
    dtype: torch.dtype,
    directory: Path,
) -> None:
    """Give the meta-device model memory on ``devices[0]`` (the stacked routed experts on ``devices[1]``) and the
    read tensors: no dequantised copy of the routed experts or kept FP8 linears is ever made (their modules go
    before the model gets memory)."""
    device, expert_device = devices
    experts.drop_modules(model)
    fp8.drop_modules(model)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, param in model.state_dict(keep_vars=True).items():
            value = values[name]
            kept = _KEEP_STORED.search(name) and value.dtype in FP8_DTYPES
            param.data = value.to(device=device, dtype=value.dtype if kept else parameter_dtype(name, param, dtype))
    fp8.install(model, device)
    try:
        experts.pack_into(model, expert_device)
    except ExpertPackingError as exc:
        raise CheckpointError(f"{directory}: {exc}") from None


def engram_hasher_for(directory: Path, config: ModelConfigV41) -> EngramHasher:
    """The Engram hasher of a V4.1 checkpoint: its compressed vocabulary comes from the checkpoint's tokenizer."""
    try:
        tokenizer = Tokenizer.from_dir(directory)
    except TokenizerLoadError as exc:
        raise CheckpointError(f"{directory}: the Engram layers need the checkpoint's tokenizer ({exc})") from None
    try:
        return EngramHasher.from_tokenizer(tokenizer, **config.engram_hasher_options())
    except ValueError as exc:
        raise CheckpointError(f"{directory / 'tokenizer.json'}: {exc}") from None


def parameter_dtype(name: str, tensor: torch.Tensor, compute_dtype: torch.dtype) -> torch.dtype:
    """Integer tables keep their dtype; mHC, sinks, norms, ``ape`` and router bias stay float32."""
    if not tensor.is_floating_point():
        return tensor.dtype
    return torch.float32 if _FP32_PARAMETER.search(name) else compute_dtype
