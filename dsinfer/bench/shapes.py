"""Model shapes for measuring without weights: V4-Flash widths with only a few layers."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from tokenizers import pre_tokenizers

from dsinfer.config import ModelConfig, QuantizationConfig
from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer
from dsinfer.tokenizer import DEEPSEEK_V4_SPECIAL_TOKENS, TOKENIZER_FILE


def flash_slice_config(num_layers: int, nextn: int = 0) -> ModelConfig:
    """Every V4-Flash width (hidden 4096, 64 x 512 heads, 256 experts x 2048, indexer 64 x 128, window 128) with
    ``num_layers`` layers cycling window / CSA / HCA, one hash-routed layer and ``nextn`` MTP layers."""
    kinds = (0, 4, 128)
    ratios = tuple(kinds[i % 3] for i in range(num_layers))
    return replace(
        ModelConfig(),
        num_hidden_layers=num_layers,
        compress_ratios=ratios,
        num_hash_layers=1,
        num_nextn_predict_layers=nextn,
    )


def write_slice_directory(directory: str | Path, num_layers: int, nextn: int = 0) -> Path:
    """``config.json`` of :func:`flash_slice_config` and a tokenizer of its whole vocabulary, no weights: what
    ``--load-format dummy`` serves (random prompts need only the ids; the tokenizer's pieces are synthetic, and
    every one decodes to text, so a served stream carries a chunk per token as a real model's does)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # The release's formats declared, as the dummy weights draw them (FP4 experts, FP8 block-scaled linears): the
    # start-up plan and `dsinfer plan` then size the experts as what the GPU and the host store hold.
    config = replace(flash_slice_config(num_layers, nextn), quantization=QuantizationConfig())
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    build_tiny_tokenizer(directory, vocab_size=config.vocab_size, filler="words")
    words_into_vocabulary(directory / TOKENIZER_FILE)
    return directory


def words_into_vocabulary(tokenizer_file: Path) -> int:
    """Move the filler words of a ``filler="words"`` tokenizer from its added tokens into its BPE vocabulary (same
    ids, byte-level spelling); returns how many moved.

    The server treats every added token as a control token (as DeepSeek's are: chat roles, ``<think>``, reserved
    slots) and streams none of them, so word fillers left among the added tokens made a random-weight slice's
    streams almost empty. In the vocabulary they are ordinary words, as a real tokenizer's are: each decodes to
    its text and streams as a chunk of its own. (Encoding their text gives the pieces the merges know, not the
    filler's id; prompts only need the ids to exist.)"""
    data = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    named = set(DEEPSEEK_V4_SPECIAL_TOKENS)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocabulary, kept = data["model"]["vocab"], []
    for token in data["added_tokens"]:
        if token["special"] or token["content"] in named:
            kept.append(token)
            continue
        ((spelling, _),) = byte_level.pre_tokenize_str(token["content"])
        if vocabulary.setdefault(spelling, token["id"]) != token["id"]:
            raise ValueError(f"filler {token['content']!r} is spelled like BPE token {vocabulary[spelling]}")
    moved = len(data["added_tokens"]) - len(kept)
    data["added_tokens"] = kept
    tokenizer_file.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return moved
