"""Offline throughput of the engine, and where each step's time goes (scheduling vs. model vs. sampling).

    python benchmarks/offline_throughput.py                                   # tiny checkpoint, CPU
    python benchmarks/offline_throughput.py --flash-layers 3 --device cuda --dtype bfloat16 \
        --num-prompts 64 --input-len 1024 --output-len 64

The same workload runs twice in one process, with overlap scheduling off and on (``--modes``), so the
speed-up of overlapping the host's scheduling with the device's forward is a same-run ratio.

``--flash-layers N`` builds a random-weight model with every V4-Flash width (hidden 4096, 64 x 512 heads,
256 experts x 2048, indexer 64 x 128) and N layers cycling window / CSA / HCA, so the engine can be measured
at real shapes without the weights.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from dsinfer.bench.shapes import flash_slice_config  # noqa: E402
from dsinfer.config import EngineConfig  # noqa: E402
from dsinfer.engine.engine import LLMEngine  # noqa: E402
from dsinfer.llm import DTYPES  # noqa: E402
from dsinfer.models.loader import load_model  # noqa: E402
from dsinfer.models.tiny import build_random_model, make_tiny_checkpoint  # noqa: E402
from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer  # noqa: E402
from dsinfer.sampling_params import SamplingParams  # noqa: E402
from dsinfer.tokenizer import Tokenizer  # noqa: E402


def build(args, workdir: Path):
    if args.flash_layers:
        config = flash_slice_config(args.flash_layers)
        model = build_random_model(config, DTYPES[args.dtype], args.device)
        build_tiny_tokenizer(workdir, vocab_size=config.vocab_size)
        return model, Tokenizer.from_dir(workdir), f"V4-Flash width, {args.flash_layers} layers, random"
    directory = Path(args.model) if args.model else make_tiny_checkpoint(workdir / "tiny")
    model = load_model(directory, dtype=DTYPES[args.dtype], device=args.device, progress=False)
    return model, Tokenizer.from_dir(directory), f"checkpoint {directory.name}"


def measure(model, tokenizer, config: EngineConfig, prompts: list[list[int]], args) -> dict:
    """Run the whole workload on a fresh engine; throughput and the split of the engine thread's time."""
    engine = LLMEngine(model, tokenizer, config)
    params = SamplingParams(temperature=0.8, seed=0, max_tokens=args.output_len, ignore_eos=True)
    # Warm-up: one short request through every code path.
    engine.add_request(prompts[0][:8], SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    for prompt in prompts:
        engine.add_request(prompt, params)
    steps = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps.append(engine.last_step)
    elapsed = time.perf_counter() - start
    engine.close()
    preemptions = engine.scheduler.num_preemptions
    del engine  # give the cache back before the next mode sizes its own from free memory
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    output_tokens = len(prompts) * args.output_len
    total = {key: sum(getattr(s, key) for s in steps) for key in ("schedule_s", "model_s", "postprocess_s")}
    return {
        "async_scheduling": config.async_scheduling,
        "elapsed_s": elapsed,
        "steps": len(steps),
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (output_tokens + len(prompts) * args.input_len) / elapsed,
        "median_step_ms": 1e3 * statistics.median(s.schedule_s + s.model_s + s.postprocess_s for s in steps),
        # Shares of the engine thread's time; with overlap, scheduling runs while the device works.
        "share_schedule": total["schedule_s"] / elapsed,
        "share_wait_for_device": total["model_s"] / elapsed,
        "share_postprocess": total["postprocess_s"] / elapsed,
        "preemptions": preemptions,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: a fresh tiny checkpoint)")
    parser.add_argument("--flash-layers", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--cache-gib", type=float, default=None, help="cache budget (default: engine default)")
    parser.add_argument("--modes", nargs="+", choices=["serial", "overlap"], default=["serial", "overlap"],
                        help="overlap off (serial) and/or on, run in this order (repeat to interleave)")  # fmt: skip
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer, label = build(args, Path(tmp))
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len + args.output_len + 1,
        device=args.device,
        dtype=args.dtype,
        cache_memory_bytes=None if args.cache_gib is None else int(args.cache_gib * 2**30),
    )
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [
        torch.randint(3, vocab - 1, (args.input_len,), generator=generator).tolist() for _ in range(args.num_prompts)
    ]
    runs = []
    for mode in args.modes:  # repeated modes interleave, so drift of the machine hits both alike
        runs.append({"mode": mode, **measure(model, tokenizer, replace(config, async_scheduling=mode == "overlap"),
                                             prompts, args)})  # fmt: skip
        print(f"{mode}: {runs[-1]['output_tokens_per_s']:.1f} output tok/s", flush=True)
    rates = {mode: statistics.median(r["output_tokens_per_s"] for r in runs if r["mode"] == mode)
             for mode in args.modes}  # fmt: skip
    result = {
        "model": label,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "runs": runs,
    }
    result["median_output_tokens_per_s"] = rates
    if {"serial", "overlap"} <= rates.keys():
        result["overlap_speedup"] = rates["overlap"] / rates["serial"]
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
