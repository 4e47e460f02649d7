"""Tiny random DeepSeek-V4 checkpoints in the real file formats (the test fixtures, ``make-tiny``), and where the
embedded default lives.

``make_tiny_checkpoint(dir)`` writes config.json, safetensors shards with an index (official tensor
names; FP8 e4m3 block-scaled linears, FP4 e2m1 routed experts, bf16 / fp32 elsewhere, as DeepSeek
stores them) and a real byte-level BPE tokenizer with DeepSeek's special tokens. The same weights are
reproducible from the seed.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsinfer.config import FP8_SCALE_BLOCK, ModelConfig, ModelConfigV41, QuantizationConfig
from dsinfer.config.vision import VisionConfig
from dsinfer.engram.vocabulary import build_compressed_vocabulary
from dsinfer.layers.moe import MoE
from dsinfer.models.deepseek_v4 import DeepseekV4
from dsinfer.models.deepseek_v41 import DeepseekV41
from dsinfer.models.expert_packing import dequantized_state_dict
from dsinfer.models.loader import INDEX_FILE, parameter_dtype
from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer
from dsinfer.ops.quant import quantize_fp4, quantize_fp8_blockwise
from dsinfer.ops.registry import resolve
from dsinfer.tokenizer import Tokenizer

TINY_VOCAB_SIZE = 512


# The widths every tiny checkpoint (V4 and V4.1) shares.
TINY_WIDTHS = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    sliding_window=16,
    max_position_embeddings=4096,
)


def tiny_config(**overrides) -> ModelConfig:
    """A V4 architecture small enough for a laptop CPU, with every layer kind and short compression spans."""
    base = ModelConfig(
        **TINY_WIDTHS,
        num_hidden_layers=4,
        num_hash_layers=1,
        compress_ratios=(0, 4, 32, 4),
        csa_ratio=4,
        hca_ratio=32,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=4,
        num_nextn_predict_layers=1,
        quantization=QuantizationConfig(weight_block_size=(128, 128), expert_dtype="fp4"),
    )
    return replace(base, **overrides)


# How DeepSeek stores each tensor (official names). Anything not listed is bf16.
_FP8 = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|shared_experts\.w[123]|[eh]_proj)\.weight$")
_FP4 = re.compile(r"ffn\.experts\.\d+\.w[123]\.weight$")
_FP32 = re.compile(r"(hc_|attn_sink|\.ape$|gate\.bias$)")


def storage_format(name: str, config: ModelConfig) -> str:
    """'fp8', 'fp4', 'fp32', 'bf16' or 'int' for an official tensor name (as the V4-Flash release stores it)."""
    if name.endswith("tid2eid"):
        return "int"
    if config.quantization is not None:
        if _FP4.search(name):
            return config.quantization.expert_dtype
        if _FP8.search(name):
            return "fp8"
    return "fp32" if _FP32.search(name) else "bf16"


@torch.no_grad()
def randomize_(model: DeepseekV4, seed: int) -> DeepseekV4:
    """Fill every weight with seeded random values that keep activations O(1) through the stack."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    cfg = model.config

    def normal(shape: torch.Size) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device)

    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith("tid2eid"):
            scores = torch.rand(tensor.shape[0], cfg.n_routed_experts, generator=generator, device=device)
            tensor.copy_(scores.argsort(dim=-1)[:, : tensor.shape[1]].to(tensor.dtype))
        elif name.endswith("norm.weight"):
            tensor.copy_(1 + 0.1 * normal(tensor.shape))
        elif name.endswith(("_scale", "hc_head_scale")):
            tensor.copy_(0.5 + torch.rand(tensor.shape, generator=generator, device=device))
        elif name.endswith(("_base", "attn_sink", ".ape", "gate.bias")):
            tensor.copy_(0.5 * normal(tensor.shape))
        elif tensor.dim() == 2:
            std = 1.0 if name.endswith("embed.weight") else tensor.shape[1] ** -0.5
            tensor.copy_(std * normal(tensor.shape))
        else:
            tensor.copy_(normal(tensor.shape))
    return model


def build_random_model(
    config: ModelConfig | ModelConfigV41,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    pack_experts: bool = True,
) -> DeepseekV4 | DeepseekV41:
    """A random-weight model (V4 or V4.1) straight from a config, on any device: for measuring without weights.

    The routed experts are stacked as a loaded checkpoint's would be (dense, in ``dtype``) unless
    ``pack_experts`` is off (training keeps them as modules).

    A V4.1 model comes without an Engram hasher (that needs a tokenizer): attach one before running it.
    """
    v41 = isinstance(config, ModelConfigV41)
    ops = resolve(torch.device(device), dtype)  # the backends a loaded checkpoint on this device would get
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: a full-width fp32 copy would not fit
    try:
        with torch.device(device):
            model = (
                randomize_v41_(DeepseekV41(config, ops=ops), seed)
                if v41
                else randomize_(DeepseekV4(config, ops=ops), seed)
            )
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, param in model.state_dict(keep_vars=True).items():
            param.data = param.data.to(parameter_dtype(name, param, dtype))
        if pack_experts:
            for module in model.modules():
                if isinstance(module, MoE):  # one layer at a time: at most one layer's copy in flight
                    module.pack(module.routed_weights())
    return model.requires_grad_(False).eval()


def quantize_like_checkpoint(model: DeepseekV4) -> dict[str, torch.Tensor]:
    """The model's weights in official storage: FP8 + ``.scale``, FP4 + ``.scale``, bf16, fp32, int32."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for name, tensor in dequantized_state_dict(model).items():
        kind = storage_format(name, cfg)
        base = name[: -len(".weight")]
        if kind == "fp8":
            out[name], out[base + ".scale"] = quantize_fp8_blockwise(tensor.float(), cfg.quantization.weight_block_size)
        elif kind == "fp4":
            out[name], out[base + ".scale"] = quantize_fp4(tensor.float(), cfg.quantization.fp4_group_size)
        elif kind == "int":
            out[name] = tensor.to(torch.int64).contiguous()
        else:
            out[name] = tensor.to(torch.float32 if kind == "fp32" else torch.bfloat16).contiguous()
    return out


def write_checkpoint(
    tensors: dict[str, torch.Tensor], config: ModelConfig | ModelConfigV41, directory: Path, num_shards: int
) -> None:
    """config.json + ``num_shards`` safetensors files + the index that maps each tensor to its shard."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    names = sorted(tensors)
    per_shard = math.ceil(len(names) / num_shards)
    weight_map, total = {}, 0
    for shard_id in range(num_shards):
        chunk = names[shard_id * per_shard : (shard_id + 1) * per_shard]
        shard_name = f"model-{shard_id + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(directory / shard_name), metadata={"format": "pt"})
        for n in chunk:
            weight_map[n] = shard_name
            total += tensors[n].numel() * tensors[n].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def make_tiny_checkpoint(
    directory: str | Path,
    seed: int = 0,
    num_shards: int = 3,
    quantized: bool = True,
    arch: str = "v4",
    vision: bool = False,
    **config_overrides,
) -> Path:
    """Write a complete tiny checkpoint directory (``arch`` 'v4' or 'v41'; V4.1 ``vision``) and return its path."""
    if arch == "v41":
        return make_tiny_checkpoint_v41(directory, seed, num_shards, quantized, vision, **config_overrides)
    if vision:
        raise ValueError("vision: only V4.1 checkpoints (arch 'v41') have a vision tower")
    if arch != "v4":
        raise ValueError(f"arch: expected 'v4' or 'v41', got {arch!r}")
    directory = Path(directory)
    config = tiny_config(**config_overrides)
    if not quantized:
        config = replace(config, quantization=None)
    model = randomize_(DeepseekV4(config), seed)
    write_checkpoint(quantize_like_checkpoint(model), config, directory, num_shards)
    build_tiny_tokenizer(directory, vocab_size=config.vocab_size)
    return directory


# ---- DeepSeek-V4.1 ---------------------------------------------------------------------------------
def tiny_config_v41(**overrides) -> ModelConfigV41:
    """A V4.1 architecture small enough for a laptop CPU with every layer role and two Engram layers.

    Layers: 0 window only; 1 ratio-2 KV + index source; 2 reuses 1; 3 a second ratio-2 source (replaces
    1's entries); 4 reuses 3; 5 the ratio-1 KV source, index and candidate source (the CED decoder starts
    here); 6 reuses 5; 7 a keyless index source re-scoring 5's keys inside the candidate blocks; 8 reuses 7.
    Engram on layers 1 (encoder) and 6 (decoder). Two DSpark stages read layers 6, 7, 8.
    ``engram_compressed_vocab_size`` must match the tokenizer (``make_tiny_checkpoint_v41`` computes it).
    """
    base = ModelConfigV41(
        **TINY_WIDTHS,
        num_hidden_layers=9,
        compress_ratios=(0, 2, 2, 2, 2, 1, 1, 1, 1),
        kv_source_layer_ids=(1, 3, 5),
        index_source_layer_ids=(1, 3, 5, 7),
        candidate_source_layer_id=5,
        candidate_topk_blocks=3,
        candidate_block_size=4,
        index_n_heads=32,  # enough heads that no score is exactly 0 after ReLU (ties make top-k ambiguous)
        index_head_dim=32,
        index_topk=6,
        engram_layer_ids=(1, 6),
        engram_vocab_size=1000,
        engram_max_ngram_size=4,
        engram_n_heads=2,
        engram_head_dim=32,
        engram_pad_id=2,
        engram_compressed_vocab_size=TINY_VOCAB_SIZE,
        num_nextn_predict_layers=2,
        dspark_block_size=3,
        dspark_noise_token_id=TINY_VOCAB_SIZE - 1,
        dspark_target_layer_ids=(6, 7, 8),
        dspark_markov_rank=8,
        dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
        image_token_id=None,
        quantization=QuantizationConfig(weight_block_size=(32, 32), expert_dtype="fp4"),
    )
    return replace(base, **overrides)


# How the V4.1 release stores each tensor (official names); anything not listed is bf16.
_FP8_V41 = re.compile(
    r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|shared_experts\.w[123]|engram\.wkv|main_proj)\.weight$"
)
_FP32_V41 = re.compile(r"(hc_|attn_sink|gate\.bias(_vl)?$|^vision\..*norm\d?\.weight$)")
_ENGRAM_TABLE = re.compile(r"engram\.embed\.(weight|scale)$")


def storage_format_v41(name: str, config: ModelConfigV41) -> str:
    """'fp8', 'fp4', 'fp32' or 'bf16' for an official V4.1 tensor name (ratio-2 compressor ``wkv`` is fp32)."""
    if config.quantization is not None:
        if _FP4.search(name):
            return config.quantization.expert_dtype
        if _FP8_V41.search(name):
            return "fp8"
    compressor_wkv = re.match(r"layers\.(\d+)\.attn\.compressor\.wkv\.weight$", name)
    if compressor_wkv and config.compress_ratios[int(compressor_wkv.group(1))] > 1:
        return "fp32"
    return "fp32" if _FP32_V41.search(name) else "bf16"


@torch.no_grad()
def randomize_v41_(model: DeepseekV41, seed: int) -> DeepseekV41:
    """V4's random fill, plus unit Engram row scales and q/k weights near one (as the reference initialises)."""
    randomize_(model, seed)
    generator = torch.Generator(device=model.embed.weight.device).manual_seed(seed + 1)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith("engram.embed.scale"):
            tensor.fill_(1.0)
        elif name.endswith(("engram.q_weight", "engram.k_weight")):
            noise = torch.randn(tensor.shape, generator=generator, device=tensor.device)
            tensor.copy_(1 + 0.1 * noise)
    return model


def quantize_like_checkpoint_v41(model: DeepseekV41) -> dict[str, torch.Tensor]:
    """The V4.1 model's weights in release storage: FP8 32x32 + ``.scale``, FP4 experts, FP8 Engram rows."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    state = dequantized_state_dict(model)
    for name, tensor in state.items():
        if _ENGRAM_TABLE.search(name):
            if name.endswith(".weight"):
                table = tensor.float() * state[name[: -len("weight")] + "scale"].repeat_interleave(FP8_SCALE_BLOCK, -1)
                base = name[: -len(".weight")]
                if cfg.quantization is None:
                    out[name] = table.to(torch.bfloat16).contiguous()
                    out[base + ".scale"] = torch.ones_like(state[base + ".scale"], dtype=torch.float32)
                else:  # one ue8m0 scale per 32 channels of each row
                    out[name], out[base + ".scale"] = quantize_fp8_blockwise(table, (1, FP8_SCALE_BLOCK))
            continue
        kind = storage_format_v41(name, cfg)
        base = name[: -len(".weight")]
        if kind == "fp8":
            out[name], out[base + ".scale"] = quantize_fp8_blockwise(tensor.float(), cfg.quantization.weight_block_size)
        elif kind == "fp4":
            out[name], out[base + ".scale"] = quantize_fp4(tensor.float(), cfg.quantization.fp4_group_size)
        else:
            out[name] = tensor.to(torch.float32 if kind == "fp32" else torch.bfloat16).contiguous()
    return out


# A vision tower small enough for CPU tests; images of about 84 x 84 pixels and up to 64 span tokens.
TINY_VISION = VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           max_image_tokens=64, min_pixels=84 * 84)  # fmt: skip
IMAGE_TOKEN = "<｜deepseek_image｜>"


def make_tiny_checkpoint_v41(
    directory: str | Path,
    seed: int = 0,
    num_shards: int = 3,
    quantized: bool = True,
    vision: bool = False,
    **config_overrides,
) -> Path:
    """A tiny V4.1 checkpoint with Engram on; its compressed Engram vocabulary is measured from the tokenizer.

    ``vision`` adds a tiny vision tower (:data:`TINY_VISION`) and sets ``image_token_id`` to the tokenizer's
    ``<｜deepseek_image｜>``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab_size = config_overrides.get("vocab_size", TINY_VOCAB_SIZE)
    build_tiny_tokenizer(directory, vocab_size=vocab_size)
    tokenizer = Tokenizer.from_dir(directory)
    compressed = int(build_compressed_vocabulary(tokenizer).max()) + 1
    if vision:
        image_id = tokenizer.token_to_id(IMAGE_TOKEN)
        config_overrides = {"vision": TINY_VISION, "image_token_id": image_id, **config_overrides}
    config = tiny_config_v41(**{"engram_compressed_vocab_size": compressed, **config_overrides})
    if not quantized:
        config = replace(config, quantization=None)
    model = randomize_v41_(DeepseekV41(config), seed)
    write_checkpoint(quantize_like_checkpoint_v41(model), config, directory, num_shards)
    return directory


#: The embedded default: a small DeepSeek-V4.1 trained by ``scripts/train_default.py`` (docs/default-model.md),
#: shipped in the release formats with its tokenizer.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_v41"


def default_model_dir() -> Path:
    """The embedded default every command uses without a model argument (the trained small V4.1)."""
    if not (DEFAULT_MODEL_DIR / INDEX_FILE).is_file():
        raise FileNotFoundError(f"the embedded default model is missing from this install ({DEFAULT_MODEL_DIR})")
    return DEFAULT_MODEL_DIR
