"""Time the reference V4 forward: a V4-Flash-width slice with random weights, and the tiny checkpoint.

    python benchmarks/forward_v4.py --slice-layers 3 --tokens 512 2048 4096 --dtype bfloat16
    python benchmarks/forward_v4.py --tiny-only

The slice keeps every V4-Flash width (hidden 4096, 64 heads x 512, 256 experts x 2048, indexer 64 x 128,
window 128) and one layer of each kind (window, CSA, HCA); the layer count is what shrinks. On CUDA it also
checks that the tiny checkpoint gives the same fp32 logits on the GPU as on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from dsinfer.bench.shapes import flash_slice_config
from dsinfer.kv.batch import PackedBatch
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import build_random_model, make_tiny_checkpoint

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(model, batch: PackedBatch, device: torch.device, repeats: int) -> list[float]:
    """Seconds per forward (logits for the last token of each sequence), after one warm-up run."""
    last = batch.last_token_indices()
    with torch.inference_mode():
        model(batch, logits_for=last)
        synchronize(device)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(batch, logits_for=last)
            synchronize(device)
            times.append(time.perf_counter() - start)
    return times


def cuda_matches_cpu(device: torch.device) -> float:
    """Relative fp32 logit difference of the tiny checkpoint between CPU and the GPU."""
    with tempfile.TemporaryDirectory() as directory:
        make_tiny_checkpoint(directory)
        cpu = load_model(directory, progress=False)
        gpu = load_model(directory, device=device, progress=False)
    sequences = [list(range(3, 300)), list(range(50, 90))]
    with torch.inference_mode():
        ref = cpu(PackedBatch.from_sequences(sequences))
        got = gpu(PackedBatch.from_sequences(sequences, device=device)).cpu()
    return ((got - ref).norm() / ref.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--slice-layers", type=int, default=3)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny-only", action="store_true")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "rows": []}

    with tempfile.TemporaryDirectory() as directory:
        make_tiny_checkpoint(directory)
        start = time.perf_counter()
        tiny = load_model(directory, device=device, progress=False)
        results["tiny_load_s"] = time.perf_counter() - start
    for tokens in (128, 1024):
        batch = PackedBatch.from_sequences([[3 + i % 500 for i in range(tokens)]], device=device)
        times = time_forward(tiny, batch, device, args.repeats)
        results["rows"].append({"model": "tiny fp32", "tokens": tokens, "median_ms": 1e3 * statistics.median(times)})
    if device.type == "cuda":
        results["tiny_cuda_vs_cpu_rel_error"] = cuda_matches_cpu(device)

    if not args.tiny_only:
        config = flash_slice_config(args.slice_layers)
        start = time.perf_counter()
        model = build_random_model(config, DTYPES[args.dtype], device)
        synchronize(device)
        results["slice_build_s"] = time.perf_counter() - start
        if device.type == "cuda":
            results["slice_gpu_memory_gib"] = torch.cuda.memory_allocated(device) / 2**30
        for tokens in args.tokens:
            batch = PackedBatch.from_sequences([list(range(tokens))], device=device)
            times = time_forward(model, batch, device, args.repeats)
            results["rows"].append(
                {
                    "model": f"V4-Flash width, {args.slice_layers} layers, {args.dtype}",
                    "tokens": tokens,
                    "median_ms": 1e3 * statistics.median(times),
                    "min_ms": 1e3 * min(times),
                    "max_ms": 1e3 * max(times),
                }
            )
            if device.type == "cuda":
                results["rows"][-1]["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30

    print(json.dumps({k: v for k, v in results.items() if k != "rows"}, indent=1))
    print(f"{'model':45s} {'tokens':>7s} {'median ms':>10s}")
    for row in results["rows"]:
        print(f"{row['model']:45s} {row['tokens']:7d} {row['median_ms']:10.1f}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
