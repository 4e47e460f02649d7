"""Keep the FP8 linears as FP8 or dequantise them to bf16 on load? Both timed at V4-Flash's linear shapes.

    python benchmarks/fp8_linear_choice.py --tokens 1 2 8 32 64 256 4096
    python benchmarks/fp8_linear_choice.py --sweep --tokens 1 32
    python benchmarks/fp8_linear_choice.py --sweep --gemv-only --tokens 1 --cold

For each of an attention layer's FP8 linears (and the shared expert's) the time of: ``bf16`` (the weight
dequantised once, then ``F.linear``: the ``dequantize`` policy) and ``fp8`` (the ``fp8_linear`` op the model runs
with the ``keep`` policy: the one-token GEMV, the Triton kernel that reads the codes up to ``MAX_KERNEL_TOKENS``
tokens, a one-pass dequantisation and cuBLAS above). Each op is captured ``--calls`` times in one CUDA graph and
timed by replays, so a launch's host cost does not count, as in the engine's decode graphs. Sums per layer are
what the policy changes in a step; the weight bytes are what it changes in memory. ``--sweep`` times the kernels'
launch shapes. ``--cold`` has each call read another copy of its weight, so that no call finds its bytes in L2 (a
graph of one weight called ten times reads weights under 50 MB mostly from L2, where a model's step never does).
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
from cold_copies import copy_count, graph_ms, mode_line, with_copies  # --cold's copies (same folder)

from dsinfer.ops.fp8_linear import Fp8Weight
from dsinfer.ops.fp8_linear.gemv_triton import Fp8GemvConfig, default_gemv, fp8_gemv
from dsinfer.ops.fp8_linear.triton import Fp8KernelConfig, choose_config, fp8_linear_kernel
from dsinfer.ops.grouped_linear import grouped_linear
from dsinfer.ops.quant import quantize_fp8_blockwise
from dsinfer.ops.registry import resolve

BLOCK = (128, 128)
# (name, out, in, groups) at V4-Flash widths: hidden 4096, q_lora 1024, 64 x 512 heads, 8 x 1024 output groups.
SHAPES = (
    ("wq_a+wkv", 1536, 4096, 1),
    ("wq_b+idx", 32768 + 8192, 1024, 1),
    ("wo_a", 8192, 4096, 8),
    ("wo_b", 4096, 8192, 1),
    ("shared w1+w3", 4096, 4096, 1),
    ("shared w2", 4096, 2048, 1),
)
# V4.1-Flash widths: hidden 5120, q_lora 1280, shared expert 2304, an Engram layer's wkv and the mHC main_proj.
SHAPES_V41 = (
    ("wq_a+wkv", 1792, 5120, 1),
    ("wq_b+idx", 32768 + 4096, 1280, 1),
    ("wo_a", 8192, 4096, 8),
    ("wo_b", 5120, 8192, 1),
    ("shared w1+w3", 4608, 5120, 1),
    ("shared w2", 5120, 2304, 1),
    ("engram wkv", 25600, 6144, 1),
    ("main_proj", 5120, 15360, 1),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 8, 32, 64, 256, 4096])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--calls", type=int, default=10, help="calls of the op per graph")
    parser.add_argument("--sweep", action="store_true", help="time the kernel's launch shapes instead")
    parser.add_argument("--gemv-only", action="store_true", help="with --sweep: only the one-token GEMV's launches")
    parser.add_argument("--model", choices=["v4", "v41"], default="v4", help="V4-Flash's or V4.1-Flash's shapes")
    parser.add_argument("--cold", action="store_true", help="calls cycle through copies of the weight: no L2 hits")
    parser.add_argument("--top", type=int, default=3, help="with --sweep: launches printed a shape (0: all)")
    args = parser.parse_args()
    shapes = SHAPES_V41 if args.model == "v41" else SHAPES
    if not torch.cuda.is_available():
        raise SystemExit("fp8_linear_choice needs a CUDA device")
    device, dtype = torch.device("cuda"), torch.bfloat16
    ops = resolve(device, dtype)
    weights = {}
    for name, rows, cols, _groups in shapes:
        dense = torch.randn(rows, cols, device=device) * cols**-0.5
        codes, scale = quantize_fp8_blockwise(dense, BLOCK)
        weights[name] = (with_copies([codes, scale], copy_count(codes.numel(), args.cold)), dense.to(dtype))
    print(f"fp8_linear backend: {ops.chosen['fp8_linear'].name}; device {torch.cuda.get_device_name()}")
    print(mode_line(args.cold, "FP8 weight and scales (bf16 rows: warm)"))
    if args.sweep:
        return sweep(args, shapes, weights, dtype)
    names = [name for name, *_ in shapes]
    print("| T | policy | " + " | ".join(names) + " | layer sum ms | weight TB/s |")
    print("| ---: | --- | " + " | ".join("---:" for _ in shapes) + " | ---: | ---: |")
    for tokens in args.tokens:
        rows = {"bf16": [], "fp8": []}
        for name, _out, cols, groups in shapes:
            copies, dense = weights[name]
            x = torch.randn(tokens, cols * groups, device=device, dtype=dtype)
            bf16 = functools.partial(grouped_linear, x, dense, groups)
            fp8 = [functools.partial(ops.fp8_linear, x, Fp8Weight(codes, scale, BLOCK), dtype, groups)
                   for codes, scale in copies]  # fmt: skip
            rows["bf16"].append(graph_ms(bf16, args.calls, args.repeats))
            rows["fp8"].append(graph_ms(fp8, args.calls, args.repeats))
        for policy, times in rows.items():
            total_bytes = sum(out * cols for _, out, cols, _ in shapes) * (2 if policy == "bf16" else 1)
            cells = " | ".join(f"{t:.4f}" for t in times)
            print(f"| {tokens} | {policy} | {cells} | {sum(times):.4f} | {total_bytes / sum(times) / 1e9:.2f} |")
    bf16_bytes = sum(out * cols * 2 for _, out, cols, _ in shapes)
    print(f"weight bytes per layer: bf16 {bf16_bytes / 2**20:.0f} MiB, fp8 {bf16_bytes / 2 / 2**20:.0f} MiB")


GEMV_GRID = list(itertools.product((8, 16), (512, 1024), (2, 4), (2, 4, 8)))
"""The GEMV's candidate launches: (rows, columns a step, warps, programs an SM); those with more than 128 weights a
thread a step are left out."""


def sweep(args, shapes, weights, dtype) -> None:
    """Every launch shape at every shape and token count; the chosen one marked, the ``--top`` fastest printed."""
    print("| T | shape | block_n | block_k | warps | stages | splits | ms | TB/s | chosen |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for tokens, (name, out, cols, groups) in itertools.product(args.tokens, shapes):
        copies, _ = weights[name]
        x = torch.randn(tokens, cols * groups, device="cuda", dtype=dtype)
        chosen = choose_config(out, out // groups, BLOCK, tokens)
        results = []
        grid = itertools.product((16, 32, 64), (2, 4), (3, 4), (1, 2, 4, 8, 16))
        configs = [] if args.gemv_only else [Fp8KernelConfig(n, 128, w, st, sp) for n, w, st, sp in grid] + [chosen]
        if tokens == 1:  # the GEMV's launches too: more bytes a step keep more in flight on the large weights
            configs += [Fp8GemvConfig(n, k, w, 0, p) for n, k, w, p in GEMV_GRID if n * k <= 4096 * w]
            chosen = default_gemv(out, groups)
        for config in configs:
            try:
                kernel = fp8_gemv if isinstance(config, Fp8GemvConfig) else fp8_linear_kernel
                launch = [functools.partial(kernel, x, Fp8Weight(codes, scale, BLOCK), dtype, groups, config=config)
                          for codes, scale in copies]  # fmt: skip
                ms = graph_ms(launch, args.calls, args.repeats)
            except Exception as error:  # a launch the GPU cannot take (shared memory): skip it
                print(f"| {tokens} | {name} | {config} | - | - | {type(error).__name__} |")
                continue
            results.append((ms, config))
        ranked = sorted(results, key=lambda r: r[0])
        for ms, config in (ranked[: args.top] if args.top else ranked) + [r for r in results if r[1] == chosen]:
            mark = "yes" if config == chosen else ""
            stages = getattr(config, "stages", f"gemv/{config.programs_per_sm}")
            print(
                f"| {tokens} | {name} | {config.block_n} | {config.block_k} | {config.warps} | {stages} "
                f"| {config.splits or 'auto'} | {ms:.4f} | {out * cols / ms / 1e9:.2f} | {mark} |"
            )


if __name__ == "__main__":
    main()
