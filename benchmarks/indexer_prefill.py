"""The lightning indexer's prefill scores on one GPU: the Triton kernel against the torch reference, V4-Flash shapes.

    python benchmarks/indexer_prefill.py                              # 4,096 and 16,384 tokens, whole prompts
    python benchmarks/indexer_prefill.py --tokens 4096 --start 8192   # a later chunk: W = (start + n) / 4
    python benchmarks/indexer_prefill.py --sweep --tokens 16384       # time launch configurations
    python benchmarks/indexer_prefill.py --sweep --tokens 8192 --start 122880 --configs 64:128:8:3 64:256:8:3:0:gluon
    python benchmarks/indexer_prefill.py --tokens 8192 --start 122880 --heads 32 --ratio 1   # V4.1's index keys

One sequence's ``tokens`` new queries at positions ``start ..``, 64 index heads x 128 (bf16 queries and keys, fp32
head weights scaled by 1 / sqrt(heads)), ratio 4: W = (start + tokens) / 4 compressed entries shared by every query,
query t seeing the (position + 1) / 4 entries whose windows have ended (``--heads`` and ``--ratio`` set both). For
each point: the median milliseconds of ``index_scores`` per backend, their ratio, the peak memory each call
allocates beyond its inputs, the largest |Triton - reference| over the finite scores (and whether -inf falls in the
same places), and of the top-k (``--topk``, lowest index first among ties) the share of queries whose chosen sets
are the same and the mean share of chosen entries the two have in common (random data: a difference is a near-tie
within fp32 rounding). ``--sweep`` times each launch of ``--configs`` (checked against the reference, computed a
slice of rows at a time) and prints them fastest first.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from fast_path_checks import cuda_ms  # the benchmarks' one CUDA-event timer (same folder)

from dsinfer.ops.index_scores import triton as backend
from dsinfer.ops.index_scores.reference import index_scores_reference, top_k_in_order

# The shared-keys launches --sweep times, 16-bit: (block_t, block_w, warps, stages, registers a thread or 0 for the
# compiler's, kernel: "triton", or "gluon" for the Hopper one: 64 x 128 at 4 warps or 64 x 256 at 8).
SWEEP_CONFIGS = [
    (64, 128, 8, 3, 0, "triton"),
    (64, 128, 8, 3, 128, "triton"),  # two programs a multiprocessor: one's products beside the other's sums
    (64, 128, 8, 2, 128, "triton"),
    (64, 256, 8, 3, 0, "gluon"),  # the next head's MMA beside this head's sums
    (64, 256, 8, 2, 0, "gluon"),
    (64, 128, 4, 3, 0, "gluon"),
    (64, 128, 4, 2, 0, "gluon"),
    (64, 128, 8, 2, 0, "triton"),
    (64, 256, 8, 2, 0, "triton"),
    (64, 128, 4, 3, 0, "triton"),
    (128, 128, 8, 2, 0, "triton"),
    (64, 64, 4, 3, 0, "triton"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--start", type=int, default=0, help="position of the chunk's first token")
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ratio", type=int, default=4, help="tokens an entry: V4's 4, V4.1's ratio-1 index keys 1")
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-reference", action="store_true", help="time the Triton op only")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--configs", nargs="+", metavar="T:W:WARPS:STAGES[:REGISTERS[:KERNEL]]",
                        help="the launches --sweep times (default: its list)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_inputs(args, tokens: int, device, gen: torch.Generator) -> tuple:
    """(q, keys, head_weights, visible) in the op's argument order."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    width = (args.start + tokens) // args.ratio
    positions = torch.arange(args.start, args.start + tokens, device=device)
    q = torch.randn(tokens, args.heads, args.head_dim, device=device, generator=gen, dtype=dtype)
    keys = torch.randn(width, args.head_dim, device=device, generator=gen, dtype=dtype)
    head_weights = torch.randn(tokens, args.heads, device=device, generator=gen) * args.heads**-0.5
    return q, keys, head_weights, torch.div(positions + 1, args.ratio, rounding_mode="floor")


def sliced_reference(inputs: tuple, rows: int = 512) -> torch.Tensor:
    """The reference's scores, ``rows`` queries at a time: its [n, H, W] products of a long chunk would not fit."""
    q, keys, head_weights, visible = inputs
    pieces = []
    for first in range(0, q.shape[0], rows):
        part = slice(first, first + rows)
        pieces.append(index_scores_reference(q[part], keys, head_weights[part], visible[part]))
    return torch.cat(pieces)


def median_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(cuda_ms(fn, iters))


def peak_bytes(fn) -> tuple[torch.Tensor, int]:
    """``fn()``'s result and the most memory allocated during it beyond what was allocated before."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


def topk_agreement(got: torch.Tensor, expected: torch.Tensor, k: int) -> tuple[float, float]:
    """(share of rows with the same chosen set, mean share of chosen entries in common) over ``k``-best."""
    chosen, real = top_k_in_order(got, k)
    want, want_real = top_k_in_order(expected, k)
    rows_same = (((chosen == want) | ~want_real).all(dim=1) & (real == want_real).all(dim=1)).float().mean().item()
    width = got.shape[1]
    mine = torch.zeros_like(got, dtype=torch.bool).scatter_(1, chosen, real)
    theirs = torch.zeros(want.shape[0], width, dtype=torch.bool, device=got.device).scatter_(1, want, want_real)
    common = (mine & theirs).sum(dim=1).float() / theirs.sum(dim=1).clamp(min=1).float()
    return rows_same, common.mean().item()


def run_point(args, tokens: int, device, gen) -> dict:
    inputs = make_inputs(args, tokens, device, gen)
    row = {"tokens": tokens, "width": inputs[1].shape[0]}
    got, row["triton_bytes"] = peak_bytes(lambda: backend.index_scores_triton(*inputs))
    row["triton_ms"] = median_ms(lambda: backend.index_scores_triton(*inputs), args.warmup, args.iters)
    if not args.no_reference:
        expected, row["reference_bytes"] = peak_bytes(lambda: index_scores_reference(*inputs))
        row["reference_ms"] = median_ms(lambda: index_scores_reference(*inputs), 1, max(3, args.iters // 3))
        finite = torch.isfinite(expected)
        row["same_inf"] = torch.equal(finite, torch.isfinite(got))
        row["max_diff"] = (got[finite] - expected[finite]).abs().max().item() if finite.any() else 0.0
        row["scale"] = expected[finite].abs().max().item() if finite.any() else 0.0
        row["rows_same"], row["common"] = topk_agreement(got, expected, args.topk)
        del expected
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'tokens':>7} {'W':>6} {'reference ms':>12} {'triton ms':>10} {'ratio':>7} {'ref GiB':>8} "
          f"{'triton GiB':>10} {'max |diff|':>10} {'max |s|':>8} {'-inf same':>9} {'top-k rows':>10} "
          f"{'common':>7}")  # fmt: skip
    gib = 2.0**30
    for r in rows:
        reference = r.get("reference_ms", float("nan"))
        print(f"{r['tokens']:>7} {r['width']:>6} {reference:>12.3f} {r['triton_ms']:>10.3f} "
              f"{reference / r['triton_ms']:>7.1f} {r.get('reference_bytes', float('nan')) / gib:>8.2f} "
              f"{r['triton_bytes'] / gib:>10.3f} {r.get('max_diff', float('nan')):>10.2e} "
              f"{r.get('scale', float('nan')):>8.2f} {str(r.get('same_inf', '-')):>9} "
              f"{r.get('rows_same', float('nan')):>10.4f} {r.get('common', float('nan')):>7.5f}")  # fmt: skip
    print("ratio: reference ms / Triton ms. GiB: peak allocated by one call beyond its inputs. top-k rows: share")
    print("of queries with the same chosen set; common: mean share of the reference's choice the Triton one keeps.")


def parse_config(text: str) -> tuple:
    """``T:W:WARPS:STAGES[:REGISTERS[:KERNEL]]`` as (block_t, block_w, warps, stages, registers, kernel)."""
    parts = text.split(":")
    if not 4 <= len(parts) <= 6:
        raise SystemExit(f"--configs: {text!r} is not T:W:WARPS:STAGES[:REGISTERS[:KERNEL]]")
    numbers = [int(part) for part in parts[:5]]
    return (*numbers, *([0] * (5 - len(numbers))), parts[5] if len(parts) == 6 else "triton")


def sweep(args, device, gen) -> None:
    print(f"{'tokens':>7} {'chosen':>21} {'ms':>8} {'best':>21} {'ms':>8}")
    label = lambda c: f"{c.block_t}x{c.block_w} w{c.num_warps} s{c.num_stages} r{c.max_registers} {c.kernel}"  # noqa: E731
    configs = [parse_config(text) for text in args.configs] if args.configs else SWEEP_CONFIGS
    for tokens in args.tokens:
        inputs = make_inputs(args, tokens, device, gen)
        expected = sliced_reference(inputs)
        finite = torch.isfinite(expected)
        timings = {}
        for block_t, block_w, warps, stages, registers, kernel in configs:
            config = backend.ScoresConfig(block_t, block_w, 0, 16, warps, stages, registers, kernel)
            try:
                out = backend.index_scores_launch(*inputs, config=config)
                if not torch.equal(torch.isfinite(out), finite) or (out[finite] - expected[finite]).abs().max() > 1e-3:
                    print(f"  {label(config)}: wrong result", file=sys.stderr)
                    continue
                timings[config] = median_ms(
                    lambda c=config, x=inputs: backend.index_scores_launch(*x, config=c), args.warmup, args.iters
                )
            except Exception as error:  # a configuration that does not build here
                print(f"  {label(config)}: {type(error).__name__}: {error}", file=sys.stderr)
        chosen = backend.choose_config(True, backend.uses_tensor_cores(inputs[0], inputs[1]), args.heads)
        chosen_label = "gluon default" if backend.hopper_shared_keys_fits(inputs[0], inputs[1]) else label(chosen)
        chosen_ms = median_ms(lambda x=inputs: backend.index_scores_launch(*x), args.warmup, args.iters)
        best = min(timings, key=timings.get)
        for config, ms in sorted(timings.items(), key=lambda item: item[1]):
            print(f"  {label(config):>21} {ms:>8.3f}")
        print(f"{tokens:>7} {chosen_label:>21} {chosen_ms:>8.3f} {label(best):>21} {timings[best]:>8.3f}")
        del expected


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("indexer_prefill: needs a CUDA device", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    print(f"{torch.cuda.get_device_name(device)}; {args.heads} index heads x {args.head_dim}, ratio {args.ratio}, "
          f"from position {args.start}, {args.dtype}, top-k {args.topk}")  # fmt: skip
    if args.sweep:
        sweep(args, device, gen)
        return 0
    print_table([run_point(args, tokens, device, gen) for tokens in args.tokens])
    return 0


if __name__ == "__main__":
    sys.exit(main())
