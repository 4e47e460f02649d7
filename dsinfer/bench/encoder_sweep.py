"""The encoder sweep: DeepInfer's ``run_sweep.sh encoder ve-800``, images per batch through the V4.1 image encoder.

    dsinfer bench sweep encoder [--vision-width flash|tiny | --config config.json] [--image-size 800]
                                [--points 1,2,4,...,64] [--device cuda] [--dtype bfloat16]
                                [--warmup-steps 2] [--measure-steps 5] [--tag ve-800] [--out-root sweeps]
    scripts/run_sweep.sh encoder ve-800

One point = one batch of ``point`` square images of ``--image-size`` pixels, encoded as the engine encodes a
prefill step's images: patches handed over from host memory, one packed pass of the vision tower (32 layers,
1024 wide at ``flash``), the aligner into the LLM width and the span layout. Weights are random, built
directly on the device in the compute dtype (RMSNorm weights float32, as loaded); ``--config`` takes the
widths from a checkpoint's ``vision_config`` and ``text_config.hidden_size``. Each timed step is one
``encode_images`` call, synchronised on CUDA. The default (``tiny`` widths on CPU) checks the tool, not speed.

Fields of each results.jsonl record: tag, mode ("encoder"), point, point_unit ("images per batch"),
image_size, planned_size [height, width], patches_per_image, tokens_per_image (the span in the prompt),
ms_per_step (mean) and median_/min_/max_/p90_ms_per_step, steps, warmup_steps, measured_s,
images_per_s_per_gpu, tokens_per_s_per_gpu (span tokens produced per second), patches_per_s_per_gpu,
throughput_kind, peak_memory_gib (CUDA), vision {widths}, text_hidden_size, weights ("random"), dtype,
device, gpu_name, ops (the backends chosen), dp_rank, seed, timestamp, dsinfer_version, torch_version.
The Pareto chart: x = ms/step, y = images/s/GPU, a point per batch size. Only dp_rank 0 writes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from dsinfer.config import ConfigError
from dsinfer.config.vision import FLASH_VISION, VisionConfig
from dsinfer.images.inputs import ImageInput
from dsinfer.images.plan import plan_image
from dsinfer.models.loader import parameter_dtype
from dsinfer.models.vision import ImageEncoder
from dsinfer.ops.registry import bind_ops, resolve

FLASH_TEXT_HIDDEN = 5120
DEFAULT_POINTS = (1, 2, 4, 8, 16, 32, 64)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsinfer bench sweep encoder",
        description="Images per batch through the V4.1 image encoder; writes results.jsonl and a Pareto PNG.",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--vision-width", choices=["flash", "tiny"], help="flash: the released V4.1 tower (default "
                        "on CUDA); tiny: a CPU-sized tower (default on CPU)")  # fmt: skip
    source.add_argument("--config", help="config.json (or its directory) of a V4.1 checkpoint: its vision_config")
    parser.add_argument("--image-size", type=int, default=800, help="side of the square test images, pixels")
    parser.add_argument("--points", help="comma-separated images per batch (default 1,2,4,...,64)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--measure-steps", type=int, default=5)
    parser.add_argument("--tag", help="output folder name (default: ve-IMAGE_SIZE)")
    parser.add_argument("--out-root", default="sweeps")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    cuda = torch.device(args.device).type == "cuda"
    if args.vision_width is None and args.config is None:
        args.vision_width = "flash" if cuda else "tiny"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.tag = args.tag or f"ve-{args.image_size}"
    try:
        args.points = [int(p) for p in args.points.split(",")] if args.points else list(DEFAULT_POINTS)
    except ValueError:
        raise ValueError(f"--points: expected comma-separated integers, got {args.points!r}") from None
    if not args.points or min(args.points) < 1:
        raise ValueError(f"--points: every point must be a positive integer, got {args.points}")
    for flag in ("image_size", "measure_steps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be at least 1, got {getattr(args, flag)}")
    if args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps: must be at least 0, got {args.warmup_steps}")
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here")
    return args


def vision_shape(args: argparse.Namespace) -> tuple[VisionConfig, int]:
    """The tower's widths and the aligner's output width."""
    if args.vision_width == "flash":
        return FLASH_VISION, FLASH_TEXT_HIDDEN
    if args.vision_width == "tiny":  # the tiny checkpoints' tower (make-tiny --arch v41 --vision)
        from dsinfer.models.tiny import TINY_VISION, tiny_config_v41

        return TINY_VISION, tiny_config_v41().hidden_size
    from dsinfer.config import ModelConfigV41

    path = Path(args.config)
    path = path / "config.json" if path.is_dir() else path
    try:
        config = ModelConfigV41.from_dict(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--config {path}: cannot read it ({exc})") from None
    if config.vision is None:
        raise ValueError(f"--config {path}: no vision_config (a text-only checkpoint)")
    return config.vision, config.hidden_size


def build_encoder(vision: VisionConfig, text_hidden: int, device: torch.device, dtype: torch.dtype) -> ImageEncoder:
    """Random weights straight on the device in ``dtype`` (never a float32 copy of the whole tower)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            encoder = ImageEncoder(vision, text_hidden)
            for name, param in encoder.named_parameters():
                if name.startswith("image_"):
                    torch.nn.init.normal_(param)
                param.data = param.data.to(parameter_dtype(name, param, dtype))
    finally:
        torch.set_default_dtype(previous)
    bind_ops(encoder, resolve(device, dtype))
    return encoder.requires_grad_(False).eval()


def sample_images(vision: VisionConfig, size: int, count: int, seed: int) -> list[ImageInput]:
    """``count`` distinct images (host memory, as the engine holds them) already planned at ``size`` x ``size``."""
    plan = plan_image(size, size, vision)
    generator = torch.Generator().manual_seed(seed)
    patches = torch.rand(plan.num_patches, vision.patch_dim, generator=generator) * 2 - 1
    return [ImageInput(patches, plan, f"bench-{seed}-{i}") for i in range(count)]


def timed(encoder: ImageEncoder, images: list[ImageInput], device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        encoder(images)
    sync()
    return time.perf_counter() - start


def run_point(encoder, vision, text_hidden, args, point: int) -> dict[str, Any]:
    device = torch.device(args.device)
    images = sample_images(vision, args.image_size, point, args.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.warmup_steps):
        timed(encoder, images, device)
    seconds = [timed(encoder, images, device) for _ in range(args.measure_steps)]
    ms = sorted(s * 1000 for s in seconds)
    mean_s = sum(seconds) / len(seconds)
    plan = images[0].plan
    record = {
        "tag": args.tag, "mode": "encoder", "point": point, "point_unit": "images per batch",
        "image_size": args.image_size, "planned_size": [plan.height, plan.width],
        "patches_per_image": plan.num_patches, "tokens_per_image": plan.num_tokens,
        "ms_per_step": 1000 * mean_s, "median_ms_per_step": statistics.median(ms), "min_ms_per_step": ms[0],
        "max_ms_per_step": ms[-1], "p90_ms_per_step": ms[min(len(ms) - 1, math.ceil(0.9 * len(ms)) - 1)],
        "steps": len(seconds), "warmup_steps": args.warmup_steps, "measured_s": sum(seconds),
        "images_per_s_per_gpu": point / mean_s, "tokens_per_s_per_gpu": point * plan.num_tokens / mean_s,
        "patches_per_s_per_gpu": point * plan.num_patches / mean_s, "throughput_kind": "images",
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "vision": asdict(vision), "text_hidden_size": text_hidden, "weights": "random",
        "model": f"V4.1 image encoder ({args.vision_width or 'config'})", "context": args.image_size,
        "dtype": args.dtype, "device": str(device), "gpu_name": _gpu_name(device),
        "ops": encoder.vision.blocks[0].attn.ops.describe(), "seed": args.seed,
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "dsinfer_version": _version(), "torch_version": torch.__version__,
    }  # fmt: skip
    return record


def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _version() -> str:
    from dsinfer import __version__

    return __version__


def run_sweep(args: argparse.Namespace, argv: list[str]) -> int:
    from dsinfer.bench.sweep import _draw, dp_rank

    writes = dp_rank() == 0
    vision, text_hidden = vision_shape(args)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    encoder = build_encoder(vision, text_hidden, device, dtype)
    out_dir = Path(args.out_root) / args.tag
    results = out_dir / "results.jsonl"
    if writes:
        out_dir.mkdir(parents=True, exist_ok=True)
        results.write_text("")
    started = datetime.now(UTC).isoformat(timespec="seconds")
    records, skipped = [], []
    for point in args.points:
        try:
            record = run_point(encoder, vision, text_hidden, args, point)
        except torch.OutOfMemoryError as exc:
            skipped.append({"point": point, "reason": f"out of memory ({str(exc).splitlines()[0]})"})
            print(f"encoder point {point:>4}: skipped, out of memory", file=sys.stderr)
            torch.cuda.empty_cache()
            continue
        records.append(record)
        print(f"encoder point {point:>4}: {record['ms_per_step']:9.2f} ms/step, "
              f"{record['images_per_s_per_gpu']:8.2f} images/s/GPU, {record['tokens_per_s_per_gpu']:10.1f} "
              f"span tokens/s/GPU", flush=True)  # fmt: skip
        if writes:
            with results.open("a") as handle:
                handle.write(json.dumps(record) + "\n")
    if not writes:
        return 0 if records else 1
    summary = {"tag": args.tag, "mode": "encoder", "argv": argv, "started": started,
               "finished": datetime.now(UTC).isoformat(timespec="seconds"), "points": [r["point"] for r in records],
               "skipped": skipped, "results": results.name,
               "pareto": _draw(records, out_dir / "pareto.png", False) if records else None}  # fmt: skip
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {out_dir}/ ({len(records)} points, {len(skipped)} skipped)")
    return 0 if records else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return run_sweep(parse_args(argv), argv)
    except (ValueError, ConfigError) as exc:
        print(f"dsinfer bench sweep encoder: error: {exc}", file=sys.stderr)
        return 2
