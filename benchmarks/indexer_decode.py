"""The lightning indexer's decode step on one GPU: scores + top-k against its HBM roofline, bf16, FP8 and FP4 keys.

    python benchmarks/indexer_decode.py                       # batch 1 8 64 256 x context 4k 16k 131k, bf16 + fp8
    python benchmarks/indexer_decode.py --batch 64 --context 131072 --keys fp8
    python benchmarks/indexer_decode.py --keys fp4 --context 131072 --fp4-layouts halves words
    python benchmarks/indexer_decode.py --keys fp4 --context 131072 --fp4-layouts words --words-launches 3:4 5:4:4 6:4:8
    python benchmarks/indexer_decode.py --keys fp4 --context 131072 --fp4-layouts words words_mma --mma-launches 4:96

FP4 keys are V4.1's: packed e2m1 with a ue8m0 exponent per 32 channels (``INDEX_KEY_FORMAT``), scored over the
ratio-1 source (every token an entry, 128 a block); each point times the scores kernel once per FP4 tile layout
(``--fp4-layouts``: ``words``, int32 words of 8 codes decoded a pair per shift and mask, one dot; ``words_mma``,
the default, on Hopper the words decoded straight into the warpgroup MMA's register operand; ``halves``, the even
and odd channels as two dots; ``joined``, the codes interleaved into one tile), a row each, and the words kernel
again for each ``--words-launches`` (key tiles in flight : warps, and optionally : the programs a multiprocessor its
chunks aim at) and the words_mma kernel for each ``--mma-launches``; the op (``op ms``) runs the default.

V4-Flash shapes: 64 index heads x 128, ratio 4 (32 entries per 128-token block), top-512, every sequence at
``context`` tokens with its own blocks; the query is bf16 (the model's dtype), the head weights float32. For each
point: the torch reference (eager), the Triton op (``indexer_topk_decode``: split-K scores, then the batched top-k)
replayed from a CUDA graph whose calls cycle through copies of the key pool (no key read from L2), its scores
kernel alone, ``torch.topk`` on the same scores for scale, the bytes the step must read (the visible keys and
their scales), GB/s, the share of the HBM roofline (3.35 TB/s H100, 4.8 TB/s H200, by the device's name), whether
the choice equals the reference's and the largest score deviation. The kernel these replaced took 10.07 ms at
64 x 131,072 on an H100 (docs/perf.md, 2026-12-06, has it beside these).
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial

import torch
from attention_decode import graph_ms, median_ms  # the benchmarks' timers (same folder)
from cold_copies import calls_over, copied_args, copy_count

from dsinfer.kv.codecs import INDEX_KEY_FORMAT, INDEX_KEY_FP8_FORMAT
from dsinfer.ops.index_scores_paged.reference import PagedIndexInputs, index_scores_paged_reference
from dsinfer.ops.index_scores_paged.triton import FP4_LAYOUTS, WORDS_MIN_TILES, choose_chunk, paged_scores_launch
from dsinfer.ops.indexer import triton as backend
from dsinfer.ops.indexer.reference import indexer_topk_decode_reference

BLOCK_TOKENS = 128
RATIO = 4
RATIOS = {"bf16": RATIO, "fp8": RATIO, "fp4": 1}  # FP4: V4.1's ratio-1 source
ENCODE_BLOCKS = 4096  # FP4 pools are encoded this many blocks at a time (the float32 temporaries stay small)
HBM_TB_S = {"H100": 3.35, "H200": 4.8}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[4096, 16384, 131072])
    parser.add_argument("--keys", nargs="+", choices=["bf16", "fp8", "fp4"], default=["bf16", "fp8"])
    parser.add_argument("--fp4-layouts", nargs="+", choices=FP4_LAYOUTS, default=list(FP4_LAYOUTS),
                        help="FP4 tile layouts of the scores kernel, timed side by side")  # fmt: skip
    parser.add_argument(
        "--words-launches",
        nargs="+",
        default=[],
        metavar="STAGES:WARPS[:PROGRAMS]",
        help="FP4 words layout: also time these launches (key tiles in flight, warps, programs a multiprocessor the "
        "chunks aim at; default the kernel's), e.g. 3:4 5:4:4",
    )
    parser.add_argument(
        "--mma-launches",
        nargs="+",
        default=[],
        metavar="STAGES:REGISTERS[:PROGRAMS]",
        help="FP4 words_mma layout (Hopper): also time these launches (key tiles in flight, a thread's register cap, "
        "0 the compiler's own; programs a multiprocessor the chunks aim at), e.g. 4:96 6:0:6",
    )
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--inner", type=int, default=10, help="calls per timed CUDA-graph replay")
    parser.add_argument("--reference-up-to", type=int, default=64 * 16384, help="largest batch x context timed "
                        "for the torch reference (its [B, W, d] gather needs memory and time)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def roofline_tb_s(device: torch.device) -> float:
    name = torch.cuda.get_device_name(device)
    return next((rate for key, rate in HBM_TB_S.items() if key in name), HBM_TB_S["H100"])


def random_fp4_keys(blocks: int, per_block: int, dim: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of random keys in the FP4 index-key format, encoded ``ENCODE_BLOCKS`` blocks at a time."""
    keys = torch.empty(blocks, per_block, dim // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(blocks, per_block, dim // INDEX_KEY_FORMAT.block, dtype=torch.uint8, device=device)
    for first in range(0, blocks, ENCODE_BLOCKS):
        count = min(ENCODE_BLOCKS, blocks - first)
        pool = torch.randn(count, per_block, dim, device=device, generator=gen, dtype=torch.bfloat16)
        keys[first : first + count], scales[first : first + count] = INDEX_KEY_FORMAT.encode(pool)
    return keys, scales


def make_step(args, batch: int, context: int, keys_form: str, device, gen) -> list:
    """The op's arguments: q, head weights, keys, block tables, visible, k, key scales."""
    ratio = RATIOS[keys_form]
    per_block = BLOCK_TOKENS // ratio
    blocks = math.ceil((context + 1) / BLOCK_TOKENS)
    if keys_form == "fp4":
        keys, scales = random_fp4_keys(batch * blocks, per_block, args.dim, device, gen)
    else:
        pool = torch.randn(batch * blocks, per_block, args.dim, device=device, generator=gen, dtype=torch.bfloat16)
        keys, scales = INDEX_KEY_FP8_FORMAT.encode(pool) if keys_form == "fp8" else (pool, None)
    return [
        torch.randn(batch, args.heads, args.dim, device=device, generator=gen, dtype=torch.bfloat16),
        torch.randn(batch, args.heads, device=device, generator=gen) * args.heads**-0.5,
        keys,
        torch.randperm(batch * blocks, device=device, generator=gen).view(batch, blocks).int(),
        torch.full((batch,), (context + 1) // ratio, device=device),
        args.topk,
        scales,
    ]


def paged_inputs(q, weights, keys, tables, visible, k, scales) -> PagedIndexInputs:
    """The op's inputs from one step's values (:func:`make_step`'s order)."""
    return PagedIndexInputs(q, weights, keys, scales, tables, visible)


def choose(*step):
    """``indexer_topk_decode``'s Triton backend on one step's values."""
    return backend.indexer_topk_decode_triton(paged_inputs(*step), step[5])


def scores_in_layout(*step, fp4_layout: str, words_launch: dict | None = None, programs: int | None = None):
    """The scores kernel alone on one step's values, FP4 tiles in ``fp4_layout`` (words: ``words_launch``, its
    chunks aiming at ``programs`` a multiprocessor; None: the kernel's own split)."""
    inputs = paged_inputs(*step)
    chunk = None
    if programs is not None:
        width = inputs.block_tables.shape[1] * inputs.keys.shape[1]
        chunk = choose_chunk(inputs.q.shape[0], width, inputs.q.device, programs, WORDS_MIN_TILES)
    return paged_scores_launch(inputs, chunk, fp4_layout=fp4_layout, words_launch=words_launch)


def layouts_to_time(args, keys_form: str) -> list[tuple[str, str, dict | None, int | None]]:
    """(label, FP4 layout, words launch, programs a multiprocessor) of every row a point prints: one for bf16 / FP8
    keys; for FP4 each layout, and the words layout again for each of ``--words-launches``."""
    if keys_form != "fp4":
        return [(keys_form, FP4_LAYOUTS[0], None, None)]
    rows = [(f"fp4/{layout}", layout, None, None) for layout in args.fp4_layouts]
    for launch in args.words_launches:
        stages, warps, *programs = (int(part) for part in launch.split(":"))
        label = f"words s{stages}w{warps}" + "".join(f"p{count}" for count in programs)
        rows.append((label, "words", {"NUM_STAGES": stages, "num_warps": warps}, programs[0] if programs else None))
    for launch in args.mma_launches:
        stages, registers, *programs = (int(part) for part in launch.split(":"))
        label = f"mma s{stages}r{registers}" + "".join(f"p{count}" for count in programs)
        rows.append(
            (label, "words_mma", {"NUM_STAGES": stages, "maxnreg": registers}, programs[0] if programs else None)
        )
    return rows


def run_point(args, batch: int, context: int, keys_form: str, device, gen) -> None:
    """One row per FP4 layout (one row for bf16 / FP8 keys, which have none): the op, the scores kernel, top-k."""
    values = make_step(args, batch, context, keys_form, device, gen)
    q, weights, keys, tables, visible, k, scales = values
    row_bytes = keys[0, 0].nbytes + (0 if scales is None else scales[0, 0].nbytes)
    moved = int(visible.sum()) * row_bytes
    cycle = copied_args(values, (2,) if scales is None else (2, 6), copy_count(moved, True))
    op_ms = graph_ms(calls_over(choose, cycle), args.warmup, args.iters, args.inner)
    same, exact, reference_ms = "-", None, float("nan")
    if batch * context <= args.reference_up_to:
        reference = partial(indexer_topk_decode_reference, paged_inputs(*values), k)
        chosen, real = choose(*values)
        want, want_real = reference()
        same = str(torch.equal(real, want_real) and torch.equal(chosen[real], want[want_real]))
        exact = index_scores_paged_reference(paged_inputs(*values))
        reference_ms = median_ms(reference, args.warmup, args.iters)
    roof = moved / (roofline_tb_s(device) * 1e12) * 1e3
    for label, layout, launch, programs in layouts_to_time(args, keys_form):
        score = partial(scores_in_layout, fp4_layout=layout, words_launch=launch, programs=programs)
        scores_ms = graph_ms(calls_over(score, cycle), args.warmup, args.iters, args.inner)
        scores = score(*values)
        topk_ms = median_ms(partial(torch.topk, scores, min(k, scores.shape[1]), dim=1), args.warmup, args.iters)
        seen = None if exact is None else torch.isfinite(exact)
        deviation = float("nan") if exact is None else (scores[seen] - exact[seen]).abs().max().item()
        print(f"{label:>10} {batch:>5} {context:>7} {tables.shape[1] * keys.shape[1]:>6} {reference_ms:>9.3f} "
              f"{op_ms:>8.4f} {scores_ms:>9.4f} {topk_ms:>10.4f} {moved / op_ms / 1e6:>7.0f} "
              f"{100 * roof / op_ms:>6.1f}% {100 * roof / scores_ms:>6.1f}% {same:>5} {deviation:>9.2e}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("indexer_decode: needs a CUDA device", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    name = torch.cuda.get_device_name(device)
    print(f"{name} (roofline {roofline_tb_s(device)} TB/s); {args.heads} index heads x "
          f"{args.dim}, ratio {RATIO} (FP4: 1), top-{args.topk}; graph calls read cold keys")  # fmt: skip
    print(f"{'keys':>10} {'batch':>5} {'context':>7} {'slots':>6} {'ref ms':>9} {'op ms':>8} "
          f"{'scores ms':>9} {'torch.topk':>10} {'GB/s':>7} {'op roof':>7} {'scr roof':>7} {'same':>5} "
          f"{'score dev':>9}")  # fmt: skip
    for keys_form in args.keys:
        for batch in args.batch:
            for context in args.context:
                run_point(args, batch, context, keys_form, device, gen)
                torch.cuda.empty_cache()
    print(
        "op / scr roof: the roofline's ms (visible keys and scales at the HBM rate) / the op's or its scores "
        "kernel's graph-replay ms (FP4: in the row's layout; op: the default layout). ref: eager ms of the torch "
        "reference."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
