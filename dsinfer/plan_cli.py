"""``dsinfer plan MODEL``: what goes where on a machine, from the config alone (:mod:`dsinfer.memory_plan`), and the
same plan logged by ``dsinfer serve`` at start-up."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from dsinfer.arg_types import non_negative_number, positive_int
from dsinfer.config import ConfigError, EngineConfig, ModelConfig
from dsinfer.memory_plan import (
    GIB,
    GPU_PRESETS,
    KV_CACHE_DTYPES,
    PlanRequest,
    build_plan,
    gpu_memory_bytes,
    plan_config,
    plan_lines,
)

logger = logging.getLogger(__name__)
_DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


def expert_offload_value(text: str) -> str | float:
    """``--expert-offload``: ``auto`` or a GPU budget for routed experts in GiB (>= 0)."""
    if text.strip().lower() == "auto":
        return "auto"
    return non_negative_number(text, "GiB")


def add_expert_offload(parser: argparse.ArgumentParser) -> None:
    """``serve``'s ``--expert-offload`` and ``--expert-stats`` (:mod:`dsinfer.offload`)."""
    parser.add_argument("--expert-offload", type=expert_offload_value, default=None,
                        help="'auto' or a GPU budget in GiB for routed experts; the rest stay in host memory and are "
                        "fetched on use (default: off)")  # fmt: skip
    parser.add_argument("--expert-stats", default=None, metavar="PATH",
                        help="per-layer routing counts that choose the resident experts, read at start and written "
                        "as traffic is served (default: an even split, not kept)")  # fmt: skip


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``dsinfer plan`` on the command line's sub-commands."""
    plan = commands.add_parser("plan", help="what goes where on the GPUs and in host memory, before loading")
    plan.add_argument("model", help="checkpoint directory, config.json, or a release name: deepseek-v4-flash, "
                      "deepseek-v4.1-flash")  # fmt: skip
    plan.add_argument("--gpus", type=positive_int, default=1, help="GPUs, one rank each (experts split over them)")
    plan.add_argument("--gpu-memory", default=None, help=f"per GPU: {' or '.join(GPU_PRESETS)}, or GiB "
                      "(default: this machine's GPU, else h200)")  # fmt: skip
    plan.add_argument("--host-memory", type=float, default=None, help="GiB of host memory (default: this machine's)")
    plan.add_argument("--max-model-len", type=positive_int, default=None,
                      help="context per sequence (default: min(model's positions, 16384), the engine's)")  # fmt: skip
    plan.add_argument("--max-num-seqs", type=positive_int, default=16, help="sequences per GPU (rank)")
    plan.add_argument("--expert-offload", type=expert_offload_value, default=None,
                      help="'auto' or a GPU budget in GiB for routed experts; the rest stay in host memory "
                      "(default: off, every expert on the GPUs)")  # fmt: skip
    plan.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                      help="cache storage, the engine's --kv-cache-dtype (auto: V4 bf16, V4.1 fp8 codes; "
                      "V4 fp8: indexer keys as e4m3 codes)")  # fmt: skip
    plan.add_argument("--dtype", choices=sorted(_DTYPE_BYTES), default="bfloat16", help="compute dtype")
    plan.add_argument("--fp8-linears", choices=("dequantize", "keep"), default="dequantize",
                      help="FP8 linears on the GPU: dequantised to the dtype (CUDA's default) or kept")  # fmt: skip
    plan.add_argument("--engram-placement", choices=("device", "host", "sharded"), default=None,
                      help="V4.1 Engram tables (default: host when they exceed a quarter of the GPU)")  # fmt: skip
    plan.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of each GPU the engine uses")
    plan.add_argument("--with-drafter", action="store_true", help="count the MTP / DSpark drafter's weights and cache")


def _gpu(value: str | None) -> tuple[int, str]:
    if value is not None:
        return gpu_memory_bytes(value)
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, props.name
    return GPU_PRESETS["h200"], "H200 (assumed: no GPU here)"


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan; a plan that cannot fit is an error naming what is short (exit status 2)."""
    config, label = plan_config(args.model)
    memory, gpu_label = _gpu(args.gpu_memory)
    if args.host_memory is not None and args.host_memory <= 0:
        raise ConfigError(f"--host-memory: must be a positive number of GiB, got {args.host_memory}")
    request = PlanRequest(
        config, gpus=args.gpus, gpu_memory=memory,
        host_memory=None if args.host_memory is None else int(args.host_memory * GIB),
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, expert_offload=args.expert_offload,
        kv_cache_dtype=args.kv_cache_dtype, dtype_bytes=_DTYPE_BYTES[args.dtype], fp8_linears=args.fp8_linears,
        gpu_memory_utilization=args.gpu_memory_utilization, engram_placement=args.engram_placement,
        with_drafter=args.with_drafter,
    )  # fmt: skip
    plan = build_plan(request, label, gpu_label)
    print("\n".join(plan_lines(plan)))
    plan.check()
    return 0


def log_serving_plan(model: str | None, engine: EngineConfig, ranks: int) -> None:
    """``dsinfer serve``'s start-up plan on CUDA (the engine's own sizing then decides; a plan that does not fit
    is a warning here, not a refusal). Skipped on the CPU, without a usable GPU (the engine's own checks then say
    what is wrong) and for a model not on disk yet."""
    import torch

    if not engine.device.startswith("cuda") or not torch.cuda.is_available():
        return
    if model is None or not Path(model).exists():
        return

    from dsinfer.models.fp8_linears import resolve_fp8_linears

    config, device = ModelConfig.from_file(model), torch.device(engine.device)
    request = PlanRequest(
        config, gpus=ranks, gpu_memory=torch.cuda.get_device_properties(device).total_memory,
        max_model_len=engine.resolved_max_model_len(config), max_num_seqs=engine.max_num_seqs,
        expert_offload=engine.expert_offload, dtype_bytes=_DTYPE_BYTES[engine.dtype],
        fp8_linears=resolve_fp8_linears(None, device), gpu_memory_utilization=engine.gpu_memory_utilization,
        engram_placement=engine.engram_placement, with_drafter=engine.speculative_config is not None,
        block_tokens=engine.block_tokens, kv_cache_dtype=engine.kv_cache_dtype,
    )  # fmt: skip
    plan = build_plan(request, Path(model).name, torch.cuda.get_device_name(device))
    logger.info("%s", "\n".join(plan_lines(plan)))
