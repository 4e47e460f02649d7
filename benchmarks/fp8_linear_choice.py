"""Keep the FP8 linears as FP8 or dequantise them to bf16 on load? Both timed at V4-Flash's linear shapes.

    python benchmarks/fp8_linear_choice.py --tokens 1 32 1024 4096

For each of an attention layer's FP8 linears (and the shared expert's) the median time of: ``bf16`` (the weight
dequantised once, then ``F.linear``: the ``dequantize`` policy) and ``fp8`` (the ``fp8_linear`` op the model
would run with the ``keep`` policy: today its backend is the torch reference, which dequantises on every call).
Sums per layer are what the policy changes in a step; the weight bytes are what it changes in memory.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from fast_path_checks import cuda_ms  # the benchmarks' one CUDA-event timer (same folder)

from dsinfer.ops.quant import quantize_fp8_blockwise
from dsinfer.ops.registry import resolve

# (name, out, in) at V4-Flash widths: hidden 4096, q_lora 1024, 64 x 512 heads, 8 x 1024 output groups.
SHAPES = (
    ("wq_a", 1024, 4096),
    ("wq_b", 32768, 1024),
    ("wkv", 512, 4096),
    ("wo_b", 4096, 8192),
    ("indexer.wq_b", 8192, 1024),
    ("shared w1", 2048, 4096),
    ("shared w3", 2048, 4096),
    ("shared w2", 4096, 2048),
)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm up: the first call compiles and allocates
    return statistics.median(cuda_ms(fn, repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_linear_choice needs a CUDA device")
    device, dtype = torch.device("cuda"), torch.bfloat16
    ops = resolve(device, dtype)
    weights = {}
    for name, rows, cols in SHAPES:
        dense = torch.randn(rows, cols, device=device) * cols**-0.5
        codes, scale = quantize_fp8_blockwise(dense, (128, 128))
        weights[name] = (codes, scale, dense.to(dtype))
    print(f"fp8_linear backend: {ops.chosen['fp8_linear'].name}")
    print("| T | policy | " + " | ".join(name for name, _, _ in SHAPES) + " | layer sum ms |")
    print("| ---: | --- | " + " | ".join("---:" for _ in SHAPES) + " | ---: |")
    for tokens in args.tokens:
        x = torch.randn(tokens, 8192, device=device, dtype=dtype)
        rows = {"bf16": [], "fp8": []}
        for name, _, cols in SHAPES:
            codes, scale, dense = weights[name]
            inputs = x[:, :cols].contiguous()
            rows["bf16"].append(median_ms(lambda i=inputs, w=dense: torch.nn.functional.linear(i, w), args.repeats))
            rows["fp8"].append(
                median_ms(lambda i=inputs, c=codes, s=scale: ops.fp8_linear(i, c, s, (128, 128), dtype), args.repeats)
            )
        for policy, times in rows.items():
            cells = " | ".join(f"{t:.3f}" for t in times)
            print(f"| {tokens} | {policy} | {cells} | {sum(times):.3f} |")
    bf16_bytes = sum(rows * cols * 2 for _, rows, cols in SHAPES)
    print(f"weight bytes per layer: bf16 {bf16_bytes / 2**20:.0f} MiB, fp8 {bf16_bytes / 2 / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
