"""Prefill attention on one GPU: the Triton kernel against the torch reference at V4-Flash shapes.

    python benchmarks/attention_prefill.py                                   # CSA and HCA, 4,096 and 16,384 tokens
    python benchmarks/attention_prefill.py --tokens 4096 --sequences 4 --start 1000 --layers csa
    python benchmarks/attention_prefill.py --sweep --tokens 4096             # time launch configurations
    python benchmarks/attention_prefill.py --layers csa v41-r2 v41-r1 --coded  # V4.1-Flash's layers beside V4's CSA

A packed batch of ``--sequences`` sequences sharing ``tokens`` new tokens, each chunk starting at position
``--start`` (0: whole prompts; later: the ring holds the window before it). 64 heads x 512 (one K=V row per key,
shared by every head), a 128-position window, compressed entries in 128-token blocks: a CSA layer (ratio 4, 32
entries per block) attends to top-512 of its visible entries per token (random distinct ones here, ascending,
-1 where fewer are visible), an HCA layer (ratio 128, one entry per block) to every visible entry.

V4.1-Flash's compressed layers (``v41-r2``: the ratio-2 sources and their reusers, 32 entries per 64-token block;
``v41-r1``: the ratio-1 decoder layers, 64 per block) take the same window and top-512 but keep the indexer's
score order (what the V4.1 layer hands the op); ``--coded`` also times what V4.1's coded cache storage adds per
layer: decoding the rings of the batch (FP8 + ue8m0) and the blocks its tables name (FP4 + e4m3; once per KV
source, shared by its reusers) into the op's model-dtype layout.

For each point: the median milliseconds per call of the reference (per sequence, dense logits over blocks of
queries) and of the Triton op, their ratio, the Triton op's tokens per second, and the largest deviation of each
from the reference computed in fp32 on the same bf16 inputs (the bf16 reference's own deviation is the scale to
compare against). ``--sweep`` times each ``SWEEP_CONFIGS`` launch (or those of ``--configs``) and prints every
timing, then the best beside what ``choose_prefill_config`` picks.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

import torch
from fast_path_checks import cuda_ms  # the benchmarks' one CUDA-event timer (same folder)

from dsinfer.ops.sparse_attention import prefill_triton as backend
from dsinfer.ops.sparse_attention.prefill_reference import SparsePrefillInputs, sparse_attention_prefill_reference
from dsinfer.ops.sparse_attention.triton import DecodeConfig

RATIOS = {"csa": 4, "hca": 128, "v41-r2": 2, "v41-r1": 1}
BLOCK_TOKENS = {"csa": 128, "hca": 128, "v41-r2": 64, "v41-r1": 64}  # V4.1: 64-token blocks (lcm of its ratios)
TOP_K = ("csa", "v41-r2", "v41-r1")  # the layers that attend to an indexer's choice (the rest: every entry)
SWEEP_CONFIGS = [(16, 32, 4, 2), (32, 32, 4, 2), (32, 32, 8, 2), (32, 64, 4, 2), (64, 32, 8, 2), (64, 64, 8, 1),
                 (64, 64, 8, 2)]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--sequences", type=int, default=1)
    parser.add_argument("--start", type=int, default=0, help="position of every chunk's first token")
    parser.add_argument("--layers", nargs="+", choices=sorted(RATIOS), default=["csa", "hca"])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=512)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-reference", action="store_true", help="time the Triton op only (no deviations)")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--configs", nargs="+", default=None, metavar="H:N:W:S",
        help="--sweep these launches (heads a program : keys a tile : warps : stages) instead of SWEEP_CONFIGS",
    )  # fmt: skip
    parser.add_argument("--coded", action="store_true", help="V4.1 layers: also time decoding the coded storage")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_step(args, layer: str, tokens: int, device, gen: torch.Generator) -> dict:
    """The step's tensors in the op's argument order (each sequence its own slot and blocks)."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    ratio, batch = RATIOS[layer], args.sequences
    lengths = [tokens // batch + (1 if s < tokens % batch else 0) for s in range(batch)]
    block_tokens = BLOCK_TOKENS[layer]
    per_block = block_tokens // ratio
    blocks_per_seq = math.ceil((args.start + max(lengths)) / block_tokens)
    positions = torch.cat([torch.arange(args.start, args.start + n, device=device) for n in lengths])
    entries = torch.randn(batch * blocks_per_seq, per_block, args.head_dim, device=device, generator=gen, dtype=dtype)
    tables = torch.randperm(batch * blocks_per_seq, device=device, generator=gen).view(batch, blocks_per_seq)
    indices = None
    if layer in TOP_K:
        visible = torch.div(positions + 1, ratio, rounding_mode="floor")
        scores = torch.rand(tokens, blocks_per_seq * per_block, device=device, generator=gen)
        scores = scores.masked_fill(torch.arange(scores.shape[1], device=device) >= visible[:, None], -1.0)
        chosen = scores.topk(min(args.topk, scores.shape[1]), dim=1).indices
        if layer == "csa":  # V4's indexer hands its choice in entry order, V4.1's in score order
            chosen = chosen.sort(dim=1).values
        indices = torch.where(chosen < visible[:, None], chosen, -1)
        del scores
    rows = [0]
    for n in lengths:
        rows.append(rows[-1] + n)
    return {
        "q": torch.randn(tokens, args.heads, args.head_dim, device=device, generator=gen, dtype=dtype),
        "kv": torch.randn(tokens, args.head_dim, device=device, generator=gen, dtype=dtype),
        "positions": positions,
        "sequence_rows": torch.tensor(rows, device=device),
        "starts": torch.full((batch,), args.start, device=device),
        "slots": torch.arange(batch, device=device),
        "window_from": torch.zeros(batch, dtype=torch.long, device=device),
        "window": torch.randn(batch, args.window, args.head_dim, device=device, generator=gen, dtype=dtype),
        "window_size": args.window,
        "entries": entries,
        "block_tables": tables,
        "indices": indices,
        "compress_ratio": ratio,
        "sink": torch.randn(args.heads, device=device, generator=gen),
        "softmax_scale": args.head_dim**-0.5,
        "spans": [(args.start, n, 0) for n in lengths],
    }


def median_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(cuda_ms(fn, iters))


def as_float(step: dict) -> dict:
    return {k: v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in step.items()}


def deviation(got: torch.Tensor, exact: torch.Tensor) -> float:
    return (got.float() - exact).abs().max().item()


def run_point(args, layer: str, tokens: int, device, gen) -> dict:
    step = make_step(args, layer, tokens, device, gen)
    row = {"layer": layer, "tokens": tokens}
    if args.coded and layer.startswith("v41"):
        row["decode_ms"] = coded_decode_ms(args, step)
    triton_out = backend.sparse_attention_prefill_triton(SparsePrefillInputs(**step))
    row["triton_ms"] = median_ms(
        lambda: backend.sparse_attention_prefill_triton(SparsePrefillInputs(**step)), args.warmup, args.iters
    )
    if not args.no_reference:
        reference_out = sparse_attention_prefill_reference(SparsePrefillInputs(**step))
        row["reference_ms"] = median_ms(
            lambda: sparse_attention_prefill_reference(SparsePrefillInputs(**step)), 1, max(3, args.iters // 3)
        )
        exact = sparse_attention_prefill_reference(SparsePrefillInputs(**as_float(step)))
        row["triton_dev"], row["reference_dev"] = deviation(triton_out, exact), deviation(reference_out, exact)
    return row


def coded_decode_ms(args, step: dict) -> tuple[float, float]:
    """Milliseconds to decode the step's rings and its tables' entry blocks from V4.1's coded storage."""
    from dsinfer.kv.codecs import COMPRESSED_KV_FORMAT, WINDOW_KV_FORMAT

    dtype = step["q"].dtype
    window_codes = WINDOW_KV_FORMAT.encode(step["window"])
    entry_codes = COMPRESSED_KV_FORMAT.encode(step["entries"])
    tables = step["block_tables"]

    def rings():
        return WINDOW_KV_FORMAT.decode(*window_codes, dtype)

    def entries():
        codes, scales = (t.view(torch.uint8)[tables].view(t.dtype) for t in entry_codes)
        return COMPRESSED_KV_FORMAT.decode(codes, scales, dtype)

    return median_ms(rings, args.warmup, args.iters), median_ms(entries, args.warmup, args.iters)


def print_table(rows: list[dict]) -> None:
    print(f"{'layer':>7} {'tokens':>7} {'reference ms':>12} {'triton ms':>10} {'ratio':>7} {'tok/s':>10} "
          f"{'triton dev':>10} {'ref dev':>9} {'rings ms':>9} {'entries ms':>10}")  # fmt: skip
    for r in rows:
        reference = r.get("reference_ms", float("nan"))
        rings, entries = r.get("decode_ms", (float("nan"), float("nan")))
        print(f"{r['layer']:>7} {r['tokens']:>7} {reference:>12.3f} {r['triton_ms']:>10.3f} "
              f"{reference / r['triton_ms']:>7.1f} {r['tokens'] / r['triton_ms'] * 1e3:>10.0f} "
              f"{r.get('triton_dev', float('nan')):>10.2e} {r.get('reference_dev', float('nan')):>9.2e} "
              f"{rings:>9.3f} {entries:>10.3f}")  # fmt: skip
    print(
        "ratio: reference ms / Triton ms. dev: max |x - fp32 reference on the same inputs|. rings / entries ms "
        "(--coded, V4.1): decoding the coded storage into the op's layout (rings every layer, entries once per "
        "KV source)."
    )


def launch_configs(texts: list[str] | None, default: list) -> list[tuple[int, int, int, int]]:
    """``--configs`` (``H:N:W:S``: heads a program, keys a tile, warps, stages) as tuples; ``default`` without."""
    if not texts:
        return default
    configs = []
    for text in texts:
        parts = text.split(":")
        if len(parts) != 4 or not all(part.isdigit() and int(part) > 0 for part in parts):
            raise SystemExit(f"--configs takes H:N:W:S of positive integers, got {text!r}")
        configs.append(tuple(int(part) for part in parts))
    return configs


def sweep(args, device, gen) -> None:
    print(f"{'layer':>7} {'tokens':>7} {'chosen':>18} {'ms':>8} {'best':>18} {'ms':>8}")
    for layer in args.layers:
        for tokens in args.tokens:
            step = make_step(args, layer, tokens, device, gen)
            exact = sparse_attention_prefill_reference(SparsePrefillInputs(**as_float(step)))
            inputs = SparsePrefillInputs(**step)
            timings = {}
            for block_h, block_n, warps, stages in launch_configs(args.configs, SWEEP_CONFIGS):
                config = DecodeConfig(block_h, block_n, warps, stages)
                try:
                    out = backend.sparse_attention_prefill_launch(inputs, config=config)
                    if deviation(out, exact) > 5e-2:
                        print(f"  {config}: wrong result", file=sys.stderr)
                        continue
                    timings[config] = median_ms(
                        lambda c=config, s=inputs: backend.sparse_attention_prefill_launch(s, config=c),
                        args.warmup, args.iters,
                    )  # fmt: skip
                except Exception as error:  # a configuration that does not build here
                    print(f"  {config}: {type(error).__name__}", file=sys.stderr)
            chosen = backend.choose_prefill_config(args.heads, step["q"].dtype, args.head_dim)
            best = min(timings, key=timings.get)
            label = lambda c: f"{c.block_h}x{c.block_n} w{c.num_warps} s{c.num_stages}"  # noqa: E731
            for config, ms in sorted(timings.items(), key=lambda item: item[1]):
                print(f"  {layer} {tokens}: {label(config):>18} {ms:8.3f} ms")
            print(f"{layer:>7} {tokens:>7} {label(chosen):>18} {timings.get(chosen, float('nan')):>8.3f} "
                  f"{label(best):>18} {timings[best]:>8.3f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_prefill: needs a CUDA device", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    print(f"{torch.cuda.get_device_name(device)}; {args.heads} heads x {args.head_dim}, window {args.window}, "
          f"top-k {args.topk}, {args.sequences} sequence(s) from position {args.start}, {args.dtype}")  # fmt: skip
    if args.sweep:
        sweep(args, device, gen)
        return 0
    print_table([run_point(args, layer, tokens, device, gen) for layer in args.layers for tokens in args.tokens])
    return 0


if __name__ == "__main__":
    sys.exit(main())
