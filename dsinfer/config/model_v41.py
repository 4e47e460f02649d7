"""DeepSeek-V4.1 model configuration: parse a checkpoint's ``config.json`` into one validated object.

V4.1 configs arrive in three spellings, all normalised here:

* the released hub layout: a composite object (``model_type: deepseek_v41``) with the text fields under
  ``text_config`` and ``quantization_config`` / ``image_token_id`` at the top level;
* a flat ``deepseek_v41_text`` object (what Hugging Face's ``DeepseekV41TextConfig`` writes); its field
  names are the checkpoint's (``kv_source_layer_ids``, ``engram_layer_ids`` ...);
* DeepSeek's inference-code ``ModelArgs`` spelling (``dim``, ``n_layers``, ``kv_source_layers``,
  ``candidate_source_layer``, ``n_mtp_layers`` ...).

Defaults follow Hugging Face's ``DeepseekV41TextConfig``, including how a custom ``compress_ratios``
schedule without explicit sources picks its KV / index sources. The per-layer roles (which layer owns a
compressor, which scores, which reuses) are derived once here; the model only asks the config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dsinfer.config.model import _ALIASES as V4_ALIASES
from dsinfer.config.model import (
    ConfigError,
    ModelConfigBase,
    _quantization,
    _yarn,
    aliased_values,
    check_shared_ranges,
    int_tuple,
    quantization_dict,
)
from dsinfer.config.vision import VisionConfig

V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
# Keys only a V4.1 config has: lets a config without ``model_type`` (inference spelling) be recognised.
V41_MARKER_KEYS = ("kv_source_layer_ids", "kv_source_layers", "index_source_layer_ids", "engram_layer_ids")
RELEASED_COMPRESS_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
RELEASED_KV_SOURCES = (2, 8, 14, 20)
RELEASED_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)
FP8_SCALE_BLOCK = 32  # channels per ue8m0 scale of an Engram table row


@dataclass(frozen=True)
class ModelConfigV41(ModelConfigBase):
    """Everything the DeepSeek-V4.1 forward pass needs: the shared base (V4.1-Flash's defaults) plus its own fields."""

    hidden_size: int = 5120
    num_hidden_layers: int = 40
    q_lora_rank: int = 1280
    n_routed_experts: int = 384
    moe_intermediate_size: int = 2304
    index_n_heads: int = 32
    rms_norm_eps: float = 1e-20
    num_nextn_predict_layers: int = 3
    model_type: str = "deepseek_v41"
    gate_temp: float = 1.0
    kv_source_layer_ids: tuple[int, ...] | None = None
    index_source_layer_ids: tuple[int, ...] | None = None
    candidate_source_layer_id: int | None = None  # None: the last KV source; negative: no candidate level
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int = 16000000
    engram_num_embeddings: tuple[int, ...] = ()  # empty: derived from the primes
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] | None = None
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    image_token_id: int | None = 129264
    vision: VisionConfig | None = None  # the checkpoint's ``vision_config``; None: text only

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if not isinstance(n, int) or n <= 0:
            raise ConfigError(f"field 'num_hidden_layers': must be a positive integer, got {n!r}")
        if not self.compress_ratios:
            object.__setattr__(self, "compress_ratios", default_compress_ratios(n))
        ratios = tuple(self.compress_ratios)
        if len(ratios) < n:
            raise ConfigError(f"field 'compress_ratios': {len(ratios)} entries for {n} layers (num_hidden_layers)")
        for layer_id, ratio in enumerate(ratios):
            if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 0:
                raise ConfigError(
                    f"field 'compress_ratios': layer {layer_id} has ratio {ratio!r}; expected an integer >= 0"
                )
        # Released configs list one extra entry per DSpark layer (always 0): the backbone takes the first n.
        object.__setattr__(self, "compress_ratios", ratios[:n])
        ratios = self.compress_ratios
        kv_sources = self.kv_source_layer_ids
        if kv_sources is None:
            if ratios == RELEASED_COMPRESS_RATIOS[:n] and n == len(RELEASED_COMPRESS_RATIOS):
                kv_sources = RELEASED_KV_SOURCES
            else:  # the first layer of each run of equal non-zero ratios publishes for its run
                kv_sources = tuple(i for i in range(n) if ratios[i] and (i == 0 or ratios[i - 1] != ratios[i]))
        object.__setattr__(self, "kv_source_layer_ids", int_tuple("kv_source_layer_ids", kv_sources))
        index_sources = self.index_source_layer_ids
        if index_sources is None:
            index_sources = RELEASED_INDEX_SOURCES if self.kv_source_layer_ids == RELEASED_KV_SOURCES else kv_sources
        object.__setattr__(self, "index_source_layer_ids", int_tuple("index_source_layer_ids", index_sources))
        if self.candidate_source_layer_id is None:
            last = self.kv_source_layer_ids[-1] if self.kv_source_layer_ids else -1
            object.__setattr__(self, "candidate_source_layer_id", last)
        if self.dspark_target_layer_ids is None:
            others = [i for i in range(n) if i not in self.kv_source_layer_ids]
            object.__setattr__(self, "dspark_target_layer_ids", tuple(sorted(others[-3:])))
        object.__setattr__(
            self, "dspark_target_layer_ids", int_tuple("dspark_target_layer_ids", self.dspark_target_layer_ids)
        )
        object.__setattr__(self, "engram_layer_ids", int_tuple("engram_layer_ids", self.engram_layer_ids))
        _validate(self)
        sizes = self.derived_engram_table_sizes()
        given = tuple(self.engram_num_embeddings)
        if given and any(given) and given != sizes:
            raise ConfigError(
                f"field 'engram_num_embeddings': {list(given)} but the prime layout gives {list(sizes)} "
                "(each table has exactly the sum of its layer's bucket primes as rows)"
            )
        object.__setattr__(self, "engram_num_embeddings", sizes)

    # ---- per-layer roles ----------------------------------------------------------------------
    def kv_source_of(self, layer_id: int) -> int | None:
        """The KV source whose compressed entries ``layer_id`` attends to (the latest one at or before it)."""
        if not self.compress_ratios[layer_id]:
            return None
        return max(s for s in self.kv_source_layer_ids if s <= layer_id)

    def index_source_of(self, layer_id: int) -> int | None:
        """The index source whose top-k selection ``layer_id`` uses."""
        if not self.compress_ratios[layer_id]:
            return None
        return max(s for s in self.index_source_layer_ids if s <= layer_id)

    def is_kv_source(self, layer_id: int) -> bool:
        return layer_id in self.kv_source_layer_ids

    def is_index_source(self, layer_id: int) -> bool:
        return layer_id in self.index_source_layer_ids

    def uses_candidates(self, layer_id: int) -> bool:
        """Index sources after the candidate source choose their top-k inside its candidate blocks."""
        return 0 <= self.candidate_source_layer_id < layer_id

    @property
    def decoder_start(self) -> int | None:
        """First layer of the CED decoder: the last KV source when it is a ratio-1 (per-token) source."""
        if not self.kv_source_layer_ids:
            return None
        last = self.kv_source_layer_ids[-1]
        return last if self.compress_ratios[last] == 1 else None

    @property
    def engram_columns(self) -> int:
        """Rows read per position and Engram layer: (max n-gram size - 1) x heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    def derived_engram_table_sizes(self) -> tuple[int, ...]:
        """Rows of each Engram table: the sum of that layer's bucket primes."""
        if not self.engram_layer_ids:
            return ()
        primes = engram_primes(
            len(self.engram_layer_ids), self.engram_vocab_size, self.engram_max_ngram_size, self.engram_n_heads
        )
        return tuple(sum(p for per_n in layer for p in per_n) for layer in primes)

    def engram_hasher_options(self) -> dict[str, Any]:
        """Keyword arguments of :class:`dsinfer.engram.EngramHasher` for this model."""
        return {
            "engram_layer_ids": self.engram_layer_ids,
            "engram_vocab_size": self.engram_vocab_size,
            "engram_max_ngram_size": self.engram_max_ngram_size,
            "engram_n_heads": self.engram_n_heads,
            "engram_pad_id": self.engram_pad_id,
            "engram_compressed_vocab_size": self.engram_compressed_vocab_size,
            "image_token_id": self.image_token_id,
        }

    # ---- serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The released hub layout: a composite object with the text fields under ``text_config``."""
        text = asdict(self)
        for name in ("quantization", "yarn", "model_type", "image_token_id", "vision"):
            text.pop(name)
        for name, value in list(text.items()):
            if isinstance(value, tuple):
                text[name] = list(value)
        text["model_type"] = "deepseek_v41_text"
        yarn = self.yarn
        text["rope_scaling"] = None if yarn is None else {"rope_type": "yarn", **asdict(yarn)}
        out: dict[str, Any] = {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": "deepseek_v41",
            "image_token_id": self.image_token_id,
            "text_config": text,
        }
        if self.vision is not None:
            out["vision_config"] = self.vision.to_dict()
        if self.quantization is not None:
            out["quantization_config"] = quantization_dict(self.quantization)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfigV41:
        """Accept the composite hub layout, the flat text layout and the inference-code spelling."""
        raw = dict(raw)
        top_type = raw.get("model_type")
        if top_type is not None and top_type not in V41_MODEL_TYPES:
            raise ConfigError(f"field 'model_type': expected one of {list(V41_MODEL_TYPES)}, got {top_type!r}")
        text = raw.pop("text_config", None)
        vision = raw.get("vision_config")
        if text is not None:
            if not isinstance(text, dict):
                raise ConfigError(f"field 'text_config': expected an object, got {text!r}")
            if text.get("model_type", "deepseek_v41_text") not in V41_MODEL_TYPES:
                raise ConfigError(
                    f"field 'text_config.model_type': expected 'deepseek_v41_text', got {text['model_type']!r}"
                )
            raw = {**{k: v for k, v in raw.items() if k != "vision_config"}, **text}
        _reject_unsupported(raw)
        values = aliased_values(raw, _ALIASES)
        values["yarn"] = _yarn(raw)
        if "image_token_id" in raw and raw["image_token_id"] is None:
            values["image_token_id"] = None
        if "candidate_source_layer_id" in values and values["candidate_source_layer_id"] < 0:
            values["candidate_source_layer_id"] = -1
        values["quantization"] = _quantization(raw, default_block=(32, 32))
        if vision is not None:
            values["vision"] = VisionConfig.from_dict(vision)
        return cls(model_type="deepseek_v41", **cls.typed_fields(values, skip=("model_type",)))


def default_compress_ratios(num_layers: int) -> tuple[int, ...]:
    """The released schedule, or (other depths) the same shape scaled: 2 window layers, ratio-2, ratio-1."""
    if num_layers == len(RELEASED_COMPRESS_RATIOS):
        return RELEASED_COMPRESS_RATIOS
    n_window = min(2, num_layers)
    n_encoder = max(0, (num_layers - n_window + 1) // 2)
    return (0,) * n_window + (2,) * n_encoder + (1,) * max(0, num_layers - n_window - n_encoder)


# Internal name -> other spellings: V4's table for the fields V4.1 shares, plus V4.1's own (inference-code
# ModelArgs and third-party port spellings).
_ALIASES: dict[str, tuple[str, ...]] = {
    **{name: spellings for name, spellings in V4_ALIASES.items() if name in ModelConfigV41.__dataclass_fields__},
    "gate_temp": (),
    "compress_ratios": (),
    "kv_source_layer_ids": ("kv_source_layers",),
    "index_source_layer_ids": ("index_source_layers",),
    "candidate_source_layer_id": ("candidate_source_layer",),
    "candidate_topk_blocks": (),
    "candidate_block_size": (),
    "engram_layer_ids": (),
    "engram_vocab_size": (),
    "engram_num_embeddings": (),
    "engram_max_ngram_size": (),
    "engram_n_heads": (),
    "engram_head_dim": (),
    "engram_pad_id": ("engram_pad_token_id",),
    "engram_compressed_vocab_size": (),
    "dspark_block_size": (),
    "dspark_noise_token_id": (),
    "dspark_target_layer_ids": (),
    "dspark_markov_rank": (),
    "dspark_n_routed_experts": (),
    "dspark_num_experts_per_tok": ("dspark_n_activated_experts",),
    "image_token_id": (),
}

# Fields the reference accepts but this engine has exactly one answer for: (field, accepted value).
_FIXED = (
    ("num_key_value_heads", 1),
    ("attention_bias", False),
    ("tie_word_embeddings", False),
    ("hidden_act", "silu"),
    ("topk_method", "noaux_tc"),
)


def _reject_unsupported(raw: dict[str, Any]) -> None:
    for name, accepted in _FIXED:
        if name in raw and raw[name] is not None and raw[name] != accepted:
            raise ConfigError(f"field {name!r}: DeepSeek-V4.1 uses {accepted!r}, got {raw[name]!r}")


def _validate(cfg: ModelConfigV41) -> None:
    """Reject impossible values and layer schedules with a message naming the field."""
    positive = (
        "candidate_topk_blocks candidate_block_size engram_vocab_size engram_n_heads engram_head_dim "
        "engram_compressed_vocab_size dspark_block_size dspark_markov_rank dspark_n_routed_experts "
        "dspark_num_experts_per_tok"
    ).split()
    check_shared_ranges(cfg, positive, [], ["gate_temp"])
    if cfg.dspark_num_experts_per_tok > cfg.dspark_n_routed_experts:
        raise ConfigError(
            f"field 'dspark_num_experts_per_tok': {cfg.dspark_num_experts_per_tok} exceeds "
            f"dspark_n_routed_experts ({cfg.dspark_n_routed_experts})"
        )
    _validate_layer_roles(cfg)
    _validate_engram(cfg)
    for name in ("bos_token_id", "eos_token_id", "dspark_noise_token_id", "engram_pad_id"):
        if not 0 <= getattr(cfg, name) < cfg.vocab_size:
            raise ConfigError(f"field {name!r}: {getattr(cfg, name)} is outside the vocabulary ({cfg.vocab_size})")
    if cfg.image_token_id is not None and not 0 <= cfg.image_token_id < cfg.vocab_size:
        raise ConfigError(f"field 'image_token_id': {cfg.image_token_id} is outside the vocabulary ({cfg.vocab_size})")
    for layer_id in cfg.dspark_target_layer_ids:
        if not 0 <= layer_id < cfg.num_hidden_layers:
            raise ConfigError(
                f"field 'dspark_target_layer_ids': layer {layer_id} is not in [0, {cfg.num_hidden_layers})"
            )
    if cfg.num_nextn_predict_layers and not cfg.dspark_target_layer_ids:
        raise ConfigError("field 'dspark_target_layer_ids': DSpark layers need at least one target layer")


def _validate_layer_roles(cfg: ModelConfigV41) -> None:
    """KV sources, index sources and the candidate source must describe a schedule the forward can run."""
    n, ratios = cfg.num_hidden_layers, cfg.compress_ratios
    kv, index = cfg.kv_source_layer_ids, cfg.index_source_layer_ids
    for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
        if list(ids) != sorted(set(ids)):
            raise ConfigError(f"field {name!r}: expected increasing distinct layer ids, got {list(ids)}")
        for layer_id in ids:
            if not 0 <= layer_id < n:
                raise ConfigError(f"field {name!r}: layer {layer_id} is not in [0, {n})")
            if ratios[layer_id] == 0:
                raise ConfigError(f"field {name!r}: layer {layer_id} has compress ratio 0 (window only)")
    for layer_id in kv:
        if layer_id not in index:
            # A new compressed cache needs its own index keys and selection; a stale selection would
            # index a different cache.
            raise ConfigError(
                f"field 'index_source_layer_ids': KV source layer {layer_id} must also be an index source"
            )
    for layer_id in range(n):
        if not ratios[layer_id]:
            continue
        sources = [s for s in kv if s <= layer_id]
        if not sources:
            raise ConfigError(
                f"field 'kv_source_layer_ids': layer {layer_id} has compress ratio {ratios[layer_id]} "
                "but no KV source at or before it"
            )
        if ratios[sources[-1]] != ratios[layer_id]:
            raise ConfigError(
                f"field 'compress_ratios': layer {layer_id} (ratio {ratios[layer_id]}) would reuse KV source "
                f"{sources[-1]} (ratio {ratios[sources[-1]]})"
            )
    candidate = cfg.candidate_source_layer_id
    if candidate >= 0 and candidate not in index:
        raise ConfigError(
            f"field 'candidate_source_layer_id': layer {candidate} is not an index source ({list(index)})"
        )
    later = [s for s in kv if s > candidate >= 0]
    if later:
        # The candidate blocks index the candidate source's entries; a newer source would replace them.
        raise ConfigError(
            f"field 'kv_source_layer_ids': KV source {later[0]} comes after the candidate source {candidate}"
        )


def _validate_engram(cfg: ModelConfigV41) -> None:
    ids = cfg.engram_layer_ids
    if len(set(ids)) != len(ids) or any(not 0 <= i < cfg.num_hidden_layers for i in ids):
        raise ConfigError(
            f"field 'engram_layer_ids': expected distinct layer ids in [0, {cfg.num_hidden_layers}), got {list(ids)}"
        )
    if cfg.engram_max_ngram_size < 2:
        raise ConfigError(f"field 'engram_max_ngram_size': must be at least 2, got {cfg.engram_max_ngram_size}")
    if cfg.engram_head_dim % FP8_SCALE_BLOCK:
        raise ConfigError(
            f"field 'engram_head_dim': {cfg.engram_head_dim} is not a multiple of {FP8_SCALE_BLOCK} (one row scale "
            f"per {FP8_SCALE_BLOCK} channels)"
        )
    given = tuple(cfg.engram_num_embeddings)
    if given and len(given) != len(ids):
        raise ConfigError(
            f"field 'engram_num_embeddings': {len(given)} entries for {len(ids)} Engram layers (engram_layer_ids)"
        )


# ---- Engram table sizes (the hashing in dsinfer.engram uses the same primes) ----------------------------
# Deterministic Miller-Rabin witnesses: exact for every n below 3.3e24.
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Exact primality test for the table-size primes (any n below 3.3e24)."""
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(num_layers: int, engram_vocab_size: int, max_ngram_size: int, n_heads: int) -> list[list[list[int]]]:
    """The bucket primes, ``[layer][n - 2][head]``: consecutive primes >= ``engram_vocab_size``.

    The reference searches each n-gram's first prime again from ``engram_vocab_size - 1``
    but skips primes already taken, which lands on the same consecutive sequence.
    """
    needed = num_layers * (max_ngram_size - 1) * n_heads
    primes: list[int] = []
    candidate = engram_vocab_size
    while len(primes) < needed:
        if is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    per_layer = (max_ngram_size - 1) * n_heads
    return [
        [primes[i * per_layer + n * n_heads : i * per_layer + (n + 1) * n_heads] for n in range(max_ngram_size - 1)]
        for i in range(num_layers)
    ]
