"""One model directory per engine, one ``config.json`` for both: the ``--flash-layers N`` slice, official spelling.

dsinfer's own slice (:func:`dsinfer.bench.shapes.flash_slice_config`) is the source of every width, layer kind
and routing choice; this module adds what only vLLM reads (the architecture name, the release's FP8 block
``quantization_config``, the MTP layer's compression entry) and writes the same bytes into both directories. Each
directory gets a tokenizer its engine reads: dsinfer's synthetic DeepSeek-shaped one, and for vLLM a word-level
one over the whole vocabulary (prompts are random token ids, so only the ids matter).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from dsinfer.bench.shapes import flash_slice_config, words_into_vocabulary
from dsinfer.config import ModelConfig
from dsinfer.models.tiny import tiny_config
from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer
from dsinfer.tokenizer import TOKENIZER_FILE

BEGIN, END = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# What deepseek-ai/DeepSeek-V4-Flash's config.json holds beyond the fields dsinfer's ModelConfig models: read by
# vLLM (and Hugging Face's config class), ignored by dsinfer.
RELEASE_ONLY_FIELDS: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "expert_dtype": "fp4",
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "num_key_value_heads": 1,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
}
# Hugging Face's spelling of the two compression rates, with the release's values: the official config spells
# them per layer only, so they are left out where they hold these (a tiny shape's other rates are kept).
HF_ONLY_FIELDS = {"compress_rate_csa": 4, "compress_rate_hca": 128}


def slice_model_config(num_layers: int, tiny: bool = False) -> ModelConfig:
    """dsinfer's ``--flash-layers N`` slice with one MTP layer (drawn by both engines only when MTP runs);
    ``tiny``: dsinfer's tiny V4 shape instead, for checking the harness on a CPU."""
    if tiny:
        return replace(tiny_config(), num_nextn_predict_layers=1)
    return replace(flash_slice_config(num_layers), num_nextn_predict_layers=1)


def release_config_dict(config: ModelConfig) -> dict[str, Any]:
    """``config.json`` in the release's spelling for ``config``: its own fields plus the release-only ones, and one
    ``compress_ratios`` entry per MTP layer (0, as the release has)."""
    data = {key: value for key, value in config.to_dict().items() if HF_ONLY_FIELDS.get(key, object()) != value}
    data.update(RELEASE_ONLY_FIELDS)
    data["compress_ratios"] = list(config.compress_ratios) + [0] * config.num_nextn_predict_layers
    return data


def write_vllm_tokenizer(directory: Path, vocab_size: int, max_length: int) -> None:
    """A word-level tokenizer with one word per id (``w3`` ... ), the first two ids DeepSeek's begin / end."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {BEGIN: 0, END: 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BEGIN,
        "eos_token": END,
        "model_max_length": max_length,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")


def write_dsinfer_tokenizer(directory: Path, vocab_size: int) -> None:
    """The tokenizer ``dsinfer make-slice`` writes: DeepSeek's specials, filler words for the rest of the ids."""
    build_tiny_tokenizer(directory, vocab_size=vocab_size, filler="words")
    words_into_vocabulary(directory / TOKENIZER_FILE)


def write_model_dirs(root: Path, config: ModelConfig) -> dict[str, Path]:
    """``root/vllm`` and ``root/dsinfer``, each with the same ``config.json`` and its engine's tokenizer."""
    text = json.dumps(release_config_dict(config), indent=2) + "\n"
    dirs = {"vllm": root / "vllm", "dsinfer": root / "dsinfer"}
    for directory in dirs.values():
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(text)
    write_vllm_tokenizer(dirs["vllm"], config.vocab_size, config.max_position_embeddings)
    write_dsinfer_tokenizer(dirs["dsinfer"], config.vocab_size)
    return dirs
