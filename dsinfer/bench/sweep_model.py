"""The model a sweep measures, built once and shared by every point: a checkpoint, or random weights of a config
or of a Flash-width slice (V4 or V4.1), with the byte accounting of the caches its engines will keep."""

from __future__ import annotations

import argparse
import math
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dsinfer.bench.shapes import flash_slice_config
from dsinfer.bench.sweep_options import DTYPES
from dsinfer.bench.v41_slice import attach_engram, engram_table_bytes, v41_slice_config, with_engram_gib
from dsinfer.config import ModelConfig, ModelConfigV41
from dsinfer.kv.sequence_bytes import KindBytes, v4_kind_bytes, v4_storages, v41_kind_bytes, v41_storages
from dsinfer.tokenizer import Tokenizer

DEFAULT_ENGRAM_GIB = 8.0  # --flash-layers --arch v41: host tables big enough that rows miss every cache


@dataclass
class Bench:
    """What every point of one sweep shares: the model (built once), its tokenizer, the options."""

    model: Any
    tokenizer: Tokenizer
    info: dict[str, Any]
    args: argparse.Namespace
    sampler: Any = None  # the sweep's TelemetrySampler while it samples
    fill_budget: int | None = None  # decode: the fill's token budget once chosen

    def telemetry_held(self):
        """Hold the GPU telemetry over decode steps: an NVML read stalls the step it meets by milliseconds."""
        return self.sampler.held() if self.sampler is not None else nullcontext()

    @property
    def device(self) -> torch.device:
        return torch.device(self.args.device)

    @property
    def is_v41(self) -> bool:
        return self.model.config.family == "v41"

    def close(self) -> None:
        """Release what the model holds outside itself (V4.1's Engram segment)."""
        close = getattr(self.model, "close", None)
        if close is not None:
            close()


def random_config(args: argparse.Namespace) -> tuple[ModelConfig | ModelConfigV41, str, str]:
    """The shape of random weights (``--flash-layers`` of ``--arch``, or ``--config``): config, label, source."""
    if args.flash_layers is not None and args.arch == "v41":
        config = v41_slice_config(args.flash_layers)
        label = f"V4.1-Flash widths, {args.flash_layers} layers"
    elif args.flash_layers is not None:
        config = flash_slice_config(args.flash_layers)
        label = f"V4-Flash widths, {args.flash_layers} layers"
    else:
        config = _engram_sized(ModelConfig.from_file(args.config), args.engram_gib)
        if args.arch == "v41" and config.family != "v41":
            raise ValueError(f"--arch v41: {args.config} is not a V4.1 config")
        return config, f"{Path(args.config).name} shape", str(Path(args.config).resolve())
    gib = DEFAULT_ENGRAM_GIB if args.engram_gib is None else args.engram_gib
    return _engram_sized(config, gib), label, f"--flash-layers {args.flash_layers} --arch {args.arch}"


def _engram_sized(config, gib: float | None):
    if gib is None or config.family != "v41":
        return config
    return with_engram_gib(config, gib)


def build_random(args: argparse.Namespace, config) -> Any:
    """Random weights of ``config`` on the device (experts packed FP4 unless ``--weight-format bf16``); V4.1's
    Engram tables go to host shared memory behind the host fetcher, read through the synthetic hasher."""
    from dsinfer.models.native_random import build_native_model
    from dsinfer.models.tiny import build_random_model

    dtype, v41 = DTYPES[args.dtype], config.family == "v41"
    drafting = args.speculative is not None
    if args.weight_format == "native":
        options = {"engram_tables": False} if v41 else {"with_mtp": drafting}
        model = build_native_model(config, dtype, args.device, seed=args.seed, **options)
    else:
        model = build_random_model(config, dtype, args.device, seed=args.seed)
        if v41:
            model.drop_engram_tables()
    return attach_engram(model, args.seed) if v41 else model


def build_bench(args: argparse.Namespace) -> Bench:
    """Load the checkpoint, or build random weights from a config; the model is shared by every point."""
    from dsinfer.models.loader import load_model
    from dsinfer.models.tiny import default_model_dir
    from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer

    if args.flash_layers is not None or args.config is not None:
        config, label, source = random_config(args)
        if args.speculative is not None and not config.num_nextn_predict_layers:
            config = replace(config, num_nextn_predict_layers=1)  # a random drafter to draft with
        model = build_random(args, config)
        with tempfile.TemporaryDirectory() as directory:  # a tokenizer only for ids; the prompts are random
            build_tiny_tokenizer(Path(directory), vocab_size=config.vocab_size)
            tokenizer = Tokenizer.from_dir(directory)
        weights = f"random ({args.weight_format})"
    else:
        directory = Path(args.model) if args.model is not None else default_model_dir()
        model = load_model(directory, dtype=DTYPES[args.dtype], device=args.device, progress=False)
        tokenizer = Tokenizer.from_dir(directory)
        label = "embedded default model" if args.model is None else f"checkpoint {directory.name}"
        source, weights = str(directory.resolve()), "checkpoint"
    return Bench(model, tokenizer, model_info(model.config, label, source, weights, args), args)


def model_info(config, label: str, source: str, weights: str, args: argparse.Namespace) -> dict[str, Any]:
    """The record fields that say what ran."""
    v41 = config.family == "v41"
    info = {
        "model": label,
        "model_source": source,
        "weights": weights,
        "arch": config.family,
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "n_routed_experts": config.n_routed_experts,
        "vocab_size": config.vocab_size,
    }
    if v41:
        info["engram_table_gib"] = engram_table_bytes(config) / 2**30 if config.engram_layer_ids else 0.0
        bounded = config.decoder_start is not None and args.speculative is None  # the engine's own default
        info["v41_prefill"] = args.v41_prefill or ("bounded" if bounded else "exact")
    return info


def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def cache_kinds(bench: Bench, tokens: int) -> tuple[dict[str, list[KindBytes]], str, list[KindBytes]]:
    """Per-kind bytes of one ``tokens``-long sequence in both storages, the engine's storage's name, and the
    engine's own per-kind bytes (its dtype: float32 on the CPU; ``--kv-cache-dtype``; V4.1 quantized while its
    rounding is on, unless bf16 is asked for)."""
    config, args = bench.model.config, bench.args
    block_tokens, drafters = bench.model.cache_block_tokens(None), 0
    if args.speculative is not None:
        drafters = config.num_nextn_predict_layers
    element = torch.finfo(DTYPES[args.dtype]).bits // 8
    if bench.is_v41:
        storages = v41_storages()
        coded = bench.model.fake_quantization and args.kv_cache_dtype != "bf16"
        name = "fp8" if coded else "bf16"
        engine_storage = replace(storages[name], element_bytes=element)
        table = {key: v41_kind_bytes(config, tokens, block_tokens, s, drafters) for key, s in storages.items()}
        return table, name, v41_kind_bytes(config, tokens, block_tokens, engine_storage, drafters)
    storages = v4_storages()
    name = "fp8" if args.kv_cache_dtype == "fp8" else "bf16"
    engine_storage = replace(storages[name], element_bytes=element)
    table = {key: v4_kind_bytes(config, tokens, block_tokens, s, drafters) for key, s in storages.items()}
    return table, name, v4_kind_bytes(config, tokens, block_tokens, engine_storage, drafters)


def decode_max_model_len(args: argparse.Namespace, num_requests: int, fill_budget: int) -> int:
    """Room for the prompt, the tokens sampled while the others still prefill, and every decode step (with
    speculation each of those steps may add K + 1 tokens to a sequence)."""
    fill_budget = max(fill_budget, num_requests)
    fill_steps_bound = math.ceil(num_requests * args.context / fill_budget) + num_requests
    per_step = 1 + (args.speculative.num_speculative_tokens if args.speculative is not None else 0)
    steps = args.warmup_steps + args.measure_steps + args.profile_steps
    return args.context + (fill_steps_bound + steps + 1) * per_step + 2


def check_fits_model(args: argparse.Namespace, config: ModelConfig) -> None:
    """The longest sequence of the sweep must fit the model's positions; say which flag to change."""
    smallest_budget = args.prefill_chunk or min(8192, args.context)
    longest = (max(decode_max_model_len(args, p, smallest_budget) for p in args.points) if args.mode == "decode"
               else args.context + 1)  # fmt: skip
    if longest > config.max_position_embeddings:
        raise ValueError(
            f"--context {args.context}: sequences reach {longest} tokens, beyond the model's "
            f"max_position_embeddings ({config.max_position_embeddings}); lower --context"
        )
