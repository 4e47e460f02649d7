"""Tiny random DeepSeek-V4 checkpoints in the real file formats: the test fixtures and the embedded default.

``make_tiny_checkpoint(dir)`` writes config.json, safetensors shards with an index (official tensor
names; FP8 e4m3 block-scaled linears, FP4 e2m1 routed experts, bf16 / fp32 elsewhere, as DeepSeek
stores them) and a real byte-level BPE tokenizer with DeepSeek's special tokens. The same weights are
reproducible from the seed.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsinfer.config import ModelConfig, QuantizationConfig
from dsinfer.layers.quant import quantize_fp4, quantize_fp8_blockwise
from dsinfer.models.deepseek_v4 import DeepseekV4
from dsinfer.models.loader import INDEX_FILE, parameter_dtype
from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer

TINY_VOCAB_SIZE = 512


def tiny_config(**overrides) -> ModelConfig:
    """A V4 architecture small enough for a laptop CPU, with every layer kind and short compression spans."""
    base = ModelConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=4,
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
        num_hash_layers=1,
        sliding_window=16,
        compress_ratios=(0, 4, 32, 4),
        csa_ratio=4,
        hca_ratio=32,
        index_n_heads=8,
        index_head_dim=32,
        index_topk=4,
        num_nextn_predict_layers=1,
        max_position_embeddings=4096,
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
    config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0
) -> DeepseekV4:
    """A random-weight model straight from a config, on any device: for measuring shapes without weights."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: a full-width fp32 copy would not fit
    try:
        with torch.device(device):
            model = randomize_(DeepseekV4(config), seed)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, param in model.state_dict(keep_vars=True).items():
            param.data = param.data.to(parameter_dtype(name, param, dtype))
    return model.requires_grad_(False).eval()


def quantize_like_checkpoint(model: DeepseekV4) -> dict[str, torch.Tensor]:
    """The model's weights in official storage: FP8 + ``.scale``, FP4 + ``.scale``, bf16, fp32, int32."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
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


def write_checkpoint(tensors: dict[str, torch.Tensor], config: ModelConfig, directory: Path, num_shards: int) -> None:
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
    directory: str | Path, seed: int = 0, num_shards: int = 3, quantized: bool = True, **config_overrides
) -> Path:
    """Write a complete tiny checkpoint directory and return its path."""
    directory = Path(directory)
    config = tiny_config(**config_overrides)
    if not quantized:
        config = replace(config, quantization=None)
    model = randomize_(DeepseekV4(config), seed)
    write_checkpoint(quantize_like_checkpoint(model), config, directory, num_shards)
    build_tiny_tokenizer(directory, vocab_size=config.vocab_size)
    return directory


def default_model_dir() -> Path:
    """The embedded default: a tiny checkpoint built once (seed 0) in the user's cache directory."""
    from dsinfer import __version__

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dsinfer" / f"tiny-v4-{__version__}"
    if not (cache / INDEX_FILE).is_file():
        staging = cache.with_name(cache.name + f".tmp{os.getpid()}")
        make_tiny_checkpoint(staging)
        try:
            staging.rename(cache)
        except OSError:  # another process finished first; keep theirs
            shutil.rmtree(staging, ignore_errors=True)
    return cache
