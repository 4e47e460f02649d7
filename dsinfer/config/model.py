"""Model configuration: parse a checkpoint's ``config.json`` into one validated, typed object.

Checkpoints reach us in two spellings: DeepSeek's own (``compress_ratios``, ``num_hash_layers``,
``rope_scaling``, or the inference-code names such as ``dim`` and ``n_layers``) and the Hugging Face
``DeepseekV4Config`` spelling (``layer_types``, ``compress_rates``, ``mlp_layer_types``,
``rope_parameters``). Both are normalised here, once, at the edge; the rest of the code only sees
:class:`ModelConfig`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsinfer.config.model_v41 import ModelConfigV41

SUPPORTED_MODEL_TYPES = ("deepseek_v4",)
# Window-only, CSA and HCA layers as the Hugging Face config names them.
HF_LAYER_TYPE_NAMES = {
    "sliding_attention": "window",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


class ConfigError(ValueError):
    """A config.json that cannot describe a model we can run; the message names the field."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN parameters applied to the rotary embedding of compressed (CSA / HCA) layers."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class QuantizationConfig:
    """How the checkpoint stores its weights: FP8 block-scaled linears, FP4 (or FP8) routed experts."""

    weight_block_size: tuple[int, int] = (128, 128)
    expert_dtype: str = "fp4"  # "fp4" (e2m1, per-32 scales), "fp8" or "bf16"
    fp4_group_size: int = 32


@dataclass(frozen=True)
class ModelConfigBase:
    """The architecture V4 and V4.1 share (V4-Flash's defaults): one base, each variant adds its own fields.

    Attention (shared-KV MQA with a sliding window, low-rank queries, grouped output), the lightning indexer's
    widths, the routed MoE, mHC and RoPE are described by the same fields in both; :class:`ModelConfig` adds
    V4's hash routing and CSA / HCA ratios, :class:`~dsinfer.config.model_v41.ModelConfigV41` its layer roles,
    Engram, DSpark and vision.
    """

    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = ()
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnScaling | None = field(default_factory=YarnScaling)
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 1
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    quantization: QuantizationConfig | None = None
    model_type: str = "deepseek_v4"

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def family(self) -> str:
        """``v41`` or ``v4``: names the family where a label or a chat format (deepseek-recipe's variant) needs it."""
        return "v41" if self.model_type.startswith("deepseek_v41") else "v4"

    @classmethod
    def typed_fields(cls, values: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
        """The parsed ``values`` that name a field of ``cls``, each checked against its type (errors name it)."""
        return {
            name: typed_value(name, spec.type, values[name])
            for name, spec in cls.__dataclass_fields__.items()
            if name in values and name not in skip
        }


@dataclass(frozen=True)
class ModelConfig(ModelConfigBase):
    """Everything the DeepSeek-V4 forward pass needs to know about the architecture."""

    num_hash_layers: int = 3
    csa_ratio: int = 4
    hca_ratio: int = 128

    def __post_init__(self) -> None:
        if not self.compress_ratios:
            object.__setattr__(self, "compress_ratios", default_compress_ratios(self.num_hidden_layers))
        _validate(self)

    # ---- derived views -------------------------------------------------------------------------
    def layer_kind(self, layer_id: int) -> str:
        """'window', 'csa' or 'hca' for the given layer."""
        ratio = self.compress_ratios[layer_id]
        if ratio == 0:
            return "window"
        return "csa" if ratio == self.csa_ratio else "hca"

    def is_hash_layer(self, layer_id: int) -> bool:
        """The first ``num_hash_layers`` MoE layers route by the frozen ``tid2eid`` table."""
        return layer_id < self.num_hash_layers

    def to_dict(self) -> dict[str, Any]:
        """Official-style ``config.json`` content (what :func:`ModelConfig.from_dict` reads back)."""
        data = asdict(self)
        data["compress_ratios"] = list(self.compress_ratios)
        yarn = data.pop("yarn")
        data["rope_scaling"] = None if yarn is None else {"type": "yarn", **yarn}
        data.pop("quantization")
        if self.quantization is not None:
            data["quantization_config"] = quantization_dict(self.quantization)
        data["compress_rate_csa"] = data.pop("csa_ratio")
        data["compress_rate_hca"] = data.pop("hca_ratio")
        return data

    # ---- parsing -----------------------------------------------------------------------------
    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig | ModelConfigV41:
        """Parse ``path`` (a config.json or a checkpoint directory); V4.1 configs give a ModelConfigV41."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: file not found (a checkpoint directory needs a config.json)")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object at the top level")
        try:
            return cls.from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig | ModelConfigV41:
        """Accept official, inference-code and Hugging Face key spellings; dispatch V4.1 on ``model_type``."""
        raw = dict(raw)
        if is_v41_config(raw):
            from dsinfer.config.model_v41 import ModelConfigV41

            return ModelConfigV41.from_dict(raw)
        model_type = raw.get("model_type", "deepseek_v4" if "n_layers" in raw else None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            allowed = [*SUPPORTED_MODEL_TYPES, "deepseek_v41", "deepseek_v41_text"]
            raise ConfigError(f"field 'model_type': expected one of {allowed}, got {model_type!r}")
        values: dict[str, Any] = {"model_type": model_type, **aliased_values(raw, _ALIASES)}
        if "text_config" in raw and isinstance(raw["text_config"], dict):
            raise ConfigError("field 'text_config': multimodal wrapper configs are not supported yet")
        _reject_unimplemented(raw)

        num_layers = _as_int(values, "num_hidden_layers", 43)
        csa_ratio, hca_ratio = _compress_rates(raw)
        values["csa_ratio"], values["hca_ratio"] = csa_ratio, hca_ratio
        values["compress_ratios"] = _compress_ratios(raw, num_layers, csa_ratio, hca_ratio)
        if "mlp_layer_types" in raw and raw["mlp_layer_types"] is not None:
            values["num_hash_layers"] = _hash_layers_from_types(raw["mlp_layer_types"])
        values["yarn"] = _yarn(raw)
        if "compress_rope_theta" not in values:
            compress = (raw.get("rope_parameters") or {}).get("compress")
            if isinstance(compress, dict) and "rope_theta" in compress:
                values["compress_rope_theta"] = compress["rope_theta"]
            main = (raw.get("rope_parameters") or {}).get("main")
            if isinstance(main, dict) and "rope_theta" in main:
                values["rope_theta"] = main["rope_theta"]
        if "qk_rope_head_dim" not in values and raw.get("partial_rotary_factor") is not None:
            values["qk_rope_head_dim"] = round(float(raw["partial_rotary_factor"]) * _as_int(values, "head_dim", 512))
        values["quantization"] = _quantization(raw)
        return cls(**cls.typed_fields(values))


def _reject_unimplemented(raw: dict[str, Any]) -> None:
    """Fields of a Hugging Face V4 config that would change the math in ways this engine does not compute.

    Each is refused by name rather than silently ignored: a model computed with other math than its config says
    would give wrong logits with no error anywhere.
    """
    if raw.get("norm_topk_prob") is False:
        # Hugging Face's V4 renormalises the picked experts' weights whatever this flag says; the released
        # checkpoints set it true. Honouring false would disagree with the reference, ignoring it would lie.
        raise ConfigError("field 'norm_topk_prob': only true is supported (DeepSeek-V4 normalises routing weights)")
    act = raw.get("hidden_act")
    if act is not None and act != "silu":
        raise ConfigError(f"field 'hidden_act': DeepSeek-V4 experts are SwiGLU ('silu'), got {act!r}")
    main = (raw.get("rope_parameters") or {}).get("main") if isinstance(raw.get("rope_parameters"), dict) else None
    if isinstance(main, dict):
        kind = main.get("rope_type", main.get("type", "default"))
        if kind not in (None, "default"):
            raise ConfigError(
                f"field 'rope_parameters.main.rope_type': window-only layers use plain RoPE, got {kind!r}"
            )


def is_v41_config(raw: dict[str, Any]) -> bool:
    """A DeepSeek-V4.1 config: its ``model_type`` says so, or (inference spelling) a V4.1-only key is there."""
    model_type = raw.get("model_type")
    if isinstance(model_type, str):
        return model_type.startswith("deepseek_v41")
    from dsinfer.config.model_v41 import V41_MARKER_KEYS

    text = raw.get("text_config")
    return any(key in raw or (isinstance(text, dict) and key in text) for key in V41_MARKER_KEYS)


def default_compress_ratios(num_layers: int) -> tuple[int, ...]:
    """V4-Flash's schedule: two window-only layers, then CSA/HCA alternating, MTP last as window."""
    body = [4 if i % 2 == 0 else 128 for i in range(max(num_layers - 2, 0))]
    return tuple(([0, 0] + body)[:num_layers])


# Internal name -> other spellings (official hub config, inference ModelArgs, Hugging Face).
_ALIASES: dict[str, tuple[str, ...]] = {
    "vocab_size": (),
    "hidden_size": ("dim",),
    "num_hidden_layers": ("n_layers",),
    "num_attention_heads": ("n_heads",),
    "head_dim": (),
    "qk_rope_head_dim": ("rope_head_dim",),
    "q_lora_rank": (),
    "o_groups": (),
    "o_lora_rank": (),
    "n_routed_experts": ("num_local_experts",),
    "num_experts_per_tok": ("n_activated_experts",),
    "n_shared_experts": (),
    "moe_intermediate_size": ("moe_inter_dim",),
    "scoring_func": ("score_func",),
    "norm_topk_prob": (),
    "routed_scaling_factor": ("route_scale",),
    "swiglu_limit": (),
    "num_hash_layers": ("n_hash_layers",),
    "sliding_window": ("window_size",),
    "index_n_heads": (),
    "index_head_dim": (),
    "index_topk": (),
    "rope_theta": (),
    "compress_rope_theta": (),
    "hc_mult": (),
    "hc_sinkhorn_iters": (),
    "hc_eps": (),
    "rms_norm_eps": ("norm_eps",),
    "num_nextn_predict_layers": ("n_mtp_layers",),
    "max_position_embeddings": ("max_seq_len",),
    "bos_token_id": (),
    "eos_token_id": (),
}


def _coerce(name: str, value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"field {name!r}: expected a number, got {value!r}")
    if kind is int:
        if float(value) != int(value):
            raise ConfigError(f"field {name!r}: expected an integer, got {value!r}")
        return int(value)
    return float(value)


def aliased_values(raw: dict[str, Any], aliases: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    """Field name -> the value of its first spelling present (and not null) in ``raw``; a list ``eos_token_id``
    gives its first id."""
    values: dict[str, Any] = {}
    for name, spellings in aliases.items():
        for key in (name, *spellings):
            if key in raw and raw[key] is not None:
                values[name] = raw[key]
                break
    if isinstance(values.get("eos_token_id"), list):
        values["eos_token_id"] = values["eos_token_id"][0]
    return values


def int_tuple(name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"field {name!r}: expected a list of integers, got {value!r}")
    items = list(value)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise ConfigError(f"field {name!r}: expected a list of integers, got {items!r}")
    return tuple(items)


def typed_value(name: str, kind: str, value: Any) -> Any:
    """Check one parsed value against its dataclass field type (as written: ``"int"``, ``"tuple[int, ...]"``)."""
    if kind == "int":
        return _coerce(name, value, int)
    if kind == "int | None":
        return None if value is None else _coerce(name, value, int)
    if kind == "float":
        return _coerce(name, value, float)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"field {name!r}: expected true/false, got {value!r}")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"field {name!r}: expected a string, got {value!r}")
        return value
    if kind.startswith("tuple[int"):
        return int_tuple(name, value)
    return value


def quantization_dict(quant: QuantizationConfig) -> dict[str, Any]:
    """A ``quantization_config`` object in the official spelling (what :func:`_quantization` reads back)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": list(quant.weight_block_size),
        "expert_dtype": quant.expert_dtype,
    }


def _as_int(values: dict[str, Any], name: str, default: int) -> int:
    return _coerce(name, values.get(name, default), int)


def _compress_rates(raw: dict[str, Any]) -> tuple[int, int]:
    rates = raw.get("compress_rates") or {}
    if not isinstance(rates, dict):
        raise ConfigError(f"field 'compress_rates': expected an object, got {rates!r}")
    csa = rates.get("compressed_sparse_attention", raw.get("compress_rate_csa", 4))
    hca = rates.get("heavily_compressed_attention", raw.get("compress_rate_hca", 128))
    return _coerce("compress_rate_csa", csa, int), _coerce("compress_rate_hca", hca, int)


def _compress_ratios(raw: dict[str, Any], num_layers: int, csa: int, hca: int) -> tuple[int, ...]:
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list):
            raise ConfigError(f"field 'layer_types': expected a list, got {layer_types!r}")
        bad = [t for t in layer_types if t not in HF_LAYER_TYPE_NAMES]
        if bad:
            raise ConfigError(f"field 'layer_types': unknown entries {bad}; allowed {list(HF_LAYER_TYPE_NAMES)}")
        by_kind = {"window": 0, "csa": csa, "hca": hca}
        return tuple(by_kind[HF_LAYER_TYPE_NAMES[t]] for t in layer_types)
    ratios = raw.get("compress_ratios")
    if ratios is None:
        return default_compress_ratios(num_layers)
    if not isinstance(ratios, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios):
        raise ConfigError(f"field 'compress_ratios': expected a list of integers, got {ratios!r}")
    # Official configs list one extra entry per MTP layer; the main stack takes the first num_layers.
    if len(ratios) < num_layers:
        raise ConfigError(f"field 'compress_ratios': {len(ratios)} entries for {num_layers} layers (num_hidden_layers)")
    return tuple(ratios[:num_layers])


def _hash_layers_from_types(types: Any) -> int:
    if not isinstance(types, list) or any(t not in ("hash_moe", "moe") for t in types):
        raise ConfigError(f"field 'mlp_layer_types': expected a list of 'hash_moe' / 'moe', got {types!r}")
    count = sum(1 for t in types if t == "hash_moe")
    if types[:count] != ["hash_moe"] * count:
        raise ConfigError("field 'mlp_layer_types': 'hash_moe' layers must come first")
    return count


def _yarn(raw: dict[str, Any]) -> YarnScaling | None:
    params = raw.get("rope_scaling")
    if params is None:
        params = (raw.get("rope_parameters") or {}).get("compress")
        if params is None and isinstance(raw.get("rope_parameters"), dict):
            params = raw["rope_parameters"]
    if params is None and "rope_factor" in raw:  # inference ModelArgs spelling
        params = {
            "type": "yarn",
            "factor": raw["rope_factor"],
            "original_max_position_embeddings": raw.get("original_seq_len", 65536),
            "beta_fast": raw.get("beta_fast", 32),
            "beta_slow": raw.get("beta_slow", 1),
        }
    if params is None:
        return YarnScaling()
    if not isinstance(params, dict):
        raise ConfigError(f"field 'rope_scaling': expected an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"field 'rope_scaling.type': only 'yarn' is supported, got {kind!r}")
    if params.get("attention_factor", 1.0) != 1.0:
        raise ConfigError("field 'rope_scaling.attention_factor': DeepSeek-V4 uses 1.0 (no YaRN mscale)")
    return YarnScaling(
        factor=_coerce("rope_scaling.factor", params.get("factor", 16.0), float),
        original_max_position_embeddings=_coerce(
            "rope_scaling.original_max_position_embeddings",
            params.get("original_max_position_embeddings", 65536),
            int,
        ),
        beta_fast=_coerce("rope_scaling.beta_fast", params.get("beta_fast") or 32, float),
        beta_slow=_coerce("rope_scaling.beta_slow", params.get("beta_slow") or 1, float),
    )


def _quantization(raw: dict[str, Any], default_block: tuple[int, int] = (128, 128)) -> QuantizationConfig | None:
    """The checkpoint's weight storage; ``default_block`` when it names no block size (V4: 128, V4.1: 32)."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ConfigError(f"field 'quantization_config': expected an object, got {quant!r}")
    block = quant.get("weight_block_size", list(default_block))
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"field 'quantization_config.weight_block_size': expected [rows, cols], got {block!r}")
    expert_dtype = quant.get("expert_dtype", raw.get("expert_dtype", "fp4"))
    if expert_dtype not in ("fp4", "fp8", "bf16"):
        raise ConfigError(
            f"field 'quantization_config.expert_dtype': expected 'fp4', 'fp8' or 'bf16', got {expert_dtype!r}"
        )
    return QuantizationConfig(weight_block_size=(block[0], block[1]), expert_dtype=expert_dtype)


def check_ranges(
    cfg: Any, positive: list[str], non_negative: list[str], positive_numbers: list[str], unit_interval: list[str]
) -> None:
    """Range checks by field name, each failure naming its field (shared by the V4 and V4.1 configs)."""
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"field {name!r}: must be positive, got {getattr(cfg, name)}")
    for name in non_negative:
        if getattr(cfg, name) < 0:
            raise ConfigError(f"field {name!r}: must not be negative, got {getattr(cfg, name)}")
    for name in positive_numbers:
        if not math.isfinite(getattr(cfg, name)) or getattr(cfg, name) <= 0:
            raise ConfigError(f"field {name!r}: must be a positive number, got {getattr(cfg, name)}")
    for name in unit_interval:
        if not 0 < getattr(cfg, name) < 1:
            raise ConfigError(f"field {name!r}: must lie in (0, 1), got {getattr(cfg, name)}")


def check_attention_and_router(cfg: Any) -> None:
    """Shapes and router settings V4 and V4.1 share: experts, RoPE slice, indexer width, output groups."""
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        raise ConfigError(
            f"field 'num_experts_per_tok': {cfg.num_experts_per_tok} exceeds n_routed_experts ({cfg.n_routed_experts})"
        )
    if cfg.qk_rope_head_dim <= 0 or cfg.qk_rope_head_dim > cfg.head_dim or cfg.qk_rope_head_dim % 2:
        raise ConfigError(
            f"field 'qk_rope_head_dim': must be even and within head_dim ({cfg.head_dim}), got {cfg.qk_rope_head_dim}"
        )
    if cfg.index_head_dim < cfg.qk_rope_head_dim:
        raise ConfigError(
            f"field 'index_head_dim': {cfg.index_head_dim} is smaller than qk_rope_head_dim ({cfg.qk_rope_head_dim})"
        )
    if cfg.num_attention_heads % cfg.o_groups:
        raise ConfigError(
            f"field 'o_groups': {cfg.o_groups} does not divide num_attention_heads ({cfg.num_attention_heads})"
        )
    if cfg.scoring_func != "sqrtsoftplus":
        raise ConfigError(f"field 'scoring_func': DeepSeek-V4 uses 'sqrtsoftplus', got {cfg.scoring_func!r}")


# Range rules of the fields both variants share (each variant adds its own).
SHARED_POSITIVE = (
    "vocab_size hidden_size num_attention_heads head_dim q_lora_rank o_groups o_lora_rank n_routed_experts "
    "num_experts_per_tok moe_intermediate_size sliding_window index_n_heads index_head_dim index_topk hc_mult "
    "hc_sinkhorn_iters max_position_embeddings"
).split()
SHARED_NON_NEGATIVE = ["n_shared_experts", "num_nextn_predict_layers"]
SHARED_POSITIVE_NUMBERS = ["rope_theta", "compress_rope_theta", "routed_scaling_factor", "swiglu_limit"]
SHARED_UNIT_INTERVAL = ["hc_eps", "rms_norm_eps"]


def check_shared_ranges(
    cfg: ModelConfigBase, positive: list[str], non_negative: list[str], positive_numbers: list[str]
) -> None:
    """The shared range rules plus a variant's own (field names), then the shared shape and router rules."""
    check_ranges(
        cfg,
        [*SHARED_POSITIVE, *positive],
        [*SHARED_NON_NEGATIVE, *non_negative],
        [*SHARED_POSITIVE_NUMBERS, *positive_numbers],
        SHARED_UNIT_INTERVAL,
    )
    check_attention_and_router(cfg)
    if cfg.yarn is not None and cfg.yarn.factor < 1:
        raise ConfigError(f"field 'rope_scaling.factor': must be >= 1, got {cfg.yarn.factor}")


def _validate(cfg: ModelConfig) -> None:
    """Reject impossible values with a message naming the field."""
    check_shared_ranges(cfg, ["num_hidden_layers", "csa_ratio", "hca_ratio"], ["num_hash_layers"], [])
    if cfg.num_hash_layers > cfg.num_hidden_layers:
        raise ConfigError(
            f"field 'num_hash_layers': {cfg.num_hash_layers} exceeds num_hidden_layers ({cfg.num_hidden_layers})"
        )
    if cfg.csa_ratio == cfg.hca_ratio:
        raise ConfigError("field 'compress_rate_hca': must differ from compress_rate_csa")
    if len(cfg.compress_ratios) != cfg.num_hidden_layers:
        raise ConfigError(
            f"field 'compress_ratios': {len(cfg.compress_ratios)} entries for {cfg.num_hidden_layers} layers"
        )
    allowed = {0, cfg.csa_ratio, cfg.hca_ratio}
    for layer_id, ratio in enumerate(cfg.compress_ratios):
        if ratio not in allowed:
            raise ConfigError(f"field 'compress_ratios': layer {layer_id} has ratio {ratio}; allowed {sorted(allowed)}")
    if not 0 <= cfg.bos_token_id < cfg.vocab_size:
        raise ConfigError(f"field 'bos_token_id': {cfg.bos_token_id} is outside the vocabulary")
    if not 0 <= cfg.eos_token_id < cfg.vocab_size:
        raise ConfigError(f"field 'eos_token_id': {cfg.eos_token_id} is outside the vocabulary")
