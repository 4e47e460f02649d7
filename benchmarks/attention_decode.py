"""Decode attention on one GPU: the Triton split-K kernel against the torch reference at V4-Flash shapes.

    python benchmarks/attention_decode.py                          # CSA and HCA, batch 1 32 256, context 1k-64k
    python benchmarks/attention_decode.py --batch 32 --context 4096 --layers csa
    python benchmarks/attention_decode.py --sweep --batch 1 32 256 --context 4096   # time launch configurations
    python benchmarks/attention_decode.py --indexer                # the lightning indexer's scores + top-k
    python benchmarks/attention_decode.py --coded --batch 1 32 --context 4096   # V4.1's coded cache, each decode form
    python benchmarks/attention_decode.py --cold --batch 1 32 --context 4096    # graph calls read no cache from L2

One query token per sequence, 64 heads x 512 (one K=V row per key, shared by every head), a 128-row window ring
per sequence and compressed entries in 128-token blocks: a CSA layer (ratio 4, 32 entries per block) attends to
the indexer's top-512 of its visible entries (random distinct ones here, ascending, -1 where fewer are visible),
an HCA layer (ratio 128, one entry per block) to every visible entry. Every sequence is at ``context`` tokens.

For each point: the median milliseconds per call of the reference, of the Triton op called eagerly and of the
same op replayed from a CUDA graph (``--inner`` calls per timed graph, so launch cost is amortised as in a
captured decode step); the bytes the kernel must read (the query, the visible window rows and entries, the
output) and the GB/s that gives for the graph replay; the ratio reference / Triton; and the largest deviation
of each from the reference computed in fp32 on the same bf16 inputs (the bf16 reference's own deviation is the
scale to compare against). ``--sweep`` instead times every ``SWEEP_CONFIGS`` x ``SWEEP_SPLITS`` launch in a
CUDA graph and prints the best per point beside what ``choose_config`` / ``choose_splits`` pick.

``--indexer`` times the lightning indexer's decode op instead (64 index heads x 128, ratio 4: every entry slot
of the block table scored, the top ``--topk`` kept): reference against Triton scores + the same top-k, eager
and graph-replayed, with whether both chose the same entries and the largest score deviation.

``--coded`` times V4.1's decode attention over the coded cache instead (the same steps, the window ring as FP8
codes and the entries as FP4 codes, both rounded as V4.1 rounds them first): the reference, then the Triton op in
each of its decode forms (``DECODES`` of :mod:`dsinfer.ops.coded_attention.triton`) eager and graph-replayed, with
each form's graph-replay time against ``twice``'s and its largest deviation from the fp32 reference.

By default every call of a timed graph reads the same cache, so a step's cache bytes under L2's 50 MB (one
sequence's, at any context: about 0.7 MB for a CSA layer) are read from L2 after the first call, which a model's
step never does. ``--cold`` (any mode) has the graph's calls cycle through copies of the cache (the window ring
and the entries, or the indexer's keys; the query stays shared, as it would sit in L2 after the layer's
projections), enough copies that their reads add up to 256 MiB a cycle (``cold_copies.py``); the eager times
still read one cache.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from functools import partial

import torch
from attention_prefill import launch_configs  # --configs (same folder)
from cold_copies import calls_over, copied_args, copy_count, cycle_graph, mode_line  # --cold (same folder)
from fast_path_checks import cuda_ms  # the benchmarks' one CUDA-event timer (same folder)

from dsinfer.kv.codecs import COMPRESSED_KV_FORMAT, WINDOW_KV_FORMAT
from dsinfer.ops.coded_attention import triton as coded_backend
from dsinfer.ops.coded_attention.reference import CodedDecodeInputs, sparse_attention_decode_coded_reference
from dsinfer.ops.fake_quant import fake_quant_compressed_kv, fake_quant_window_kv
from dsinfer.ops.index_scores_paged.reference import PagedIndexInputs
from dsinfer.ops.indexer import triton as indexer_backend
from dsinfer.ops.indexer.reference import indexer_scores, indexer_topk_decode_reference
from dsinfer.ops.sparse_attention import triton as backend
from dsinfer.ops.sparse_attention.reference import SparseDecodeInputs, sparse_attention_decode_reference

BLOCK_TOKENS = 128
RATIOS = {"window": 0, "csa": 4, "hca": 128}  # window: a sliding-window layer, no compressed entries
SWEEP_CONFIGS = [  # (block_h, block_n, num_warps, num_stages); all build for sm_90 without register spills
    (16, 16, 8, 2),
    (16, 32, 8, 2),
    (16, 32, 8, 3),
    (32, 16, 8, 2),
    (32, 32, 8, 2),
    (32, 32, 8, 3),
    (32, 16, 4, 2),
]
SWEEP_SPLITS = [None, 1, 2, 4, 8, 16, 32]  # None: choose_splits


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    parser.add_argument("--layers", nargs="+", choices=sorted(RATIOS), default=["csa", "hca"])
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=512)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--inner", type=int, default=20, help="calls per timed CUDA-graph replay")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--configs", nargs="+", default=None, metavar="H:N:W:S",
        help="--sweep these launches (heads a program : keys a tile : warps : stages) instead of SWEEP_CONFIGS",
    )  # fmt: skip
    parser.add_argument("--indexer", action="store_true", help="time the indexer's scores + top-k instead")
    parser.add_argument("--coded", action="store_true", help="time V4.1's coded-cache op in each decode form instead")
    parser.add_argument("--cold", action="store_true", help="graph calls cycle through copies of the cache (no L2)")
    parser.add_argument("--index-heads", type=int, default=64)
    parser.add_argument("--index-dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def make_step(args, layer: str, batch: int, context: int, device, gen: torch.Generator) -> dict:
    """The decode step's tensors in the op's argument order (every sequence at ``context``, its own blocks)."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    ratio = RATIOS[layer] or BLOCK_TOKENS  # a window layer: entry tensors of some shape, none of them indexed
    per_block = BLOCK_TOKENS // ratio
    blocks_per_seq = math.ceil((context + 1) / BLOCK_TOKENS)
    visible = (context + 1) // ratio if RATIOS[layer] else 0  # entries the query (position ``context``) may see
    q = torch.randn(batch, args.heads, args.head_dim, device=device, generator=gen, dtype=dtype)
    window = torch.randn(batch, args.window, args.head_dim, device=device, generator=gen, dtype=dtype)
    entries = torch.randn(batch * blocks_per_seq, per_block, args.head_dim, device=device, generator=gen, dtype=dtype)
    tables = torch.randperm(batch * blocks_per_seq, device=device, generator=gen).view(batch, blocks_per_seq)
    if layer == "csa":
        k = args.topk
        scores = torch.rand(batch, blocks_per_seq * per_block, device=device, generator=gen)
        scores[:, visible:] = -1.0
        chosen = scores.topk(min(k, scores.shape[1]), dim=1).indices.sort(dim=1).values
        indices = torch.where(chosen < visible, chosen, -1)
    elif layer == "window":
        indices = torch.empty(batch, 0, dtype=torch.long, device=device)
    else:
        slots = torch.arange(blocks_per_seq * per_block, device=device).expand(batch, -1)
        indices = torch.where(slots < visible, slots, -1).contiguous()
    return {
        "q": q,
        "window": window,
        "slots": torch.arange(batch, device=device),
        "positions": torch.full((batch,), context, device=device),
        "window_from": torch.zeros(batch, dtype=torch.long, device=device),
        "entries": entries,
        "block_tables": tables,
        "indices": indices,
        "sink": torch.randn(args.heads, device=device, generator=gen),
        "softmax_scale": args.head_dim**-0.5,
    }


CACHE_ARGS = (1, 5)
"""The window ring and the entries among ``make_step``'s values: what ``--cold`` copies."""


def cache_bytes(step: dict, window_row: int | None = None, entry_row: int | None = None) -> int:
    """Bytes of the visible window rows and entries a decode attention reads (rows of ``step``'s dtype unless
    their bytes are given)."""
    window = step["window"]
    row = window.shape[-1] * window.element_size()
    window_rows = window.shape[0] * min(window.shape[1], int(step["positions"][0]) + 1)
    return window_rows * (window_row or row) + int((step["indices"] >= 0).sum()) * (entry_row or row)


def step_bytes(step: dict) -> int:
    """Bytes a decode attention must move: the query, the visible window rows and entries, the output."""
    return 2 * step["q"].numel() * step["q"].element_size() + cache_bytes(step)


def median_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(cuda_ms(fn, iters))


def launch_values(*values, **options) -> torch.Tensor:
    """The Triton launch over the op's arguments in order (the cache copies' calls pass them one by one)."""
    return backend.sparse_attention_decode_launch(SparseDecodeInputs(*values), **options)


def coded_launch_values(*values, **options) -> torch.Tensor:
    """The coded-cache Triton launch over the op's arguments in order (as :func:`launch_values`)."""
    return coded_backend.sparse_attention_decode_coded_launch(CodedDecodeInputs(*values), **options)


def graph_ms(fns, warmup: int, iters: int, inner: int) -> float:
    """Milliseconds per call of one CUDA graph of ``inner`` calls (whole cycles of ``fns``: one call, or one a copy
    of the cache)."""
    graph, calls, _ = cycle_graph(fns, inner, warmup)  # compiles outside the capture
    return median_ms(graph.replay, warmup, iters) / calls


def deviation(got: torch.Tensor, exact: torch.Tensor) -> float:
    return (got.float() - exact).abs().max().item()


def run_point(args, layer: str, batch: int, context: int, device, gen) -> dict:
    step = make_step(args, layer, batch, context, device, gen)
    values = list(step.values())
    exact = sparse_attention_decode_reference(
        SparseDecodeInputs(*[v.float() if torch.is_tensor(v) and v.is_floating_point() else v for v in values])
    )
    reference_out = sparse_attention_decode_reference(SparseDecodeInputs(*values))
    triton_out = backend.sparse_attention_decode_launch(SparseDecodeInputs(*values))
    copies = copied_args(values, CACHE_ARGS, copy_count(cache_bytes(step), args.cold))
    row = {
        "layer": layer,
        "batch": batch,
        "context": context,
        "keys": args.window + step["indices"].shape[1],
        "reference_ms": median_ms(
            lambda: sparse_attention_decode_reference(SparseDecodeInputs(*values)), args.warmup, args.iters
        ),
        "triton_ms": median_ms(
            lambda: backend.sparse_attention_decode_launch(SparseDecodeInputs(*values)), args.warmup, args.iters
        ),
        "graph_ms": graph_ms(calls_over(launch_values, copies), args.warmup, args.iters, args.inner),
        "bytes": step_bytes(step),
        "reference_dev": deviation(reference_out, exact),
        "triton_dev": deviation(triton_out, exact),
        "triton_vs_reference": deviation(triton_out, reference_out.float()),
    }
    return row


def print_table(rows: list[dict]) -> None:
    header = (f"{'layer':>5} {'batch':>5} {'context':>7} {'keys':>5} {'reference ms':>12} {'triton ms':>10} "
              f"{'graph ms':>9} {'GB/s':>7} {'ratio':>7} {'ref dev':>8} {'tri dev':>8} {'tri-ref':>8}")  # fmt: skip
    print(header)
    for r in rows:
        gbps = r["bytes"] / (r["graph_ms"] * 1e-3) / 1e9
        ratio = r["reference_ms"] / r["graph_ms"]
        print(f"{r['layer']:>5} {r['batch']:>5} {r['context']:>7} {r['keys']:>5} {r['reference_ms']:>12.4f} "
              f"{r['triton_ms']:>10.4f} {r['graph_ms']:>9.4f} {gbps:>7.0f} {ratio:>6.1f}x "
              f"{r['reference_dev']:>8.2e} {r['triton_dev']:>8.2e} {r['triton_vs_reference']:>8.2e}")  # fmt: skip
    print("ratio: reference ms / Triton graph-replay ms. dev: max |x - fp32 reference on the same inputs|.")


def sweep(args, device, gen) -> None:
    print(f"{'layer':>5} {'batch':>5} {'context':>7} {'chosen':>22} {'ms':>8} {'best':>22} {'ms':>8}")
    for layer in args.layers:
        for batch in args.batch:
            for context in args.context:
                step = make_step(args, layer, batch, context, device, gen)
                values = list(step.values())
                expected = sparse_attention_decode_reference(SparseDecodeInputs(*values)).float()
                launch = launch_values
                n_keys = args.window + step["indices"].shape[1]
                copies = copied_args(values, CACHE_ARGS, copy_count(cache_bytes(step), args.cold))
                timings = {}
                for block_h, block_n, warps, stages in launch_configs(args.configs, SWEEP_CONFIGS):
                    config = backend.DecodeConfig(block_h, block_n, warps, stages)
                    for splits in SWEEP_SPLITS:
                        call = partial(launch, *values, config=config, num_splits=splits)
                        try:
                            if deviation(call(), expected) > 5e-2:
                                print(f"  {config} splits={splits}: wrong result", file=sys.stderr)
                                continue
                            timed = calls_over(launch, copies, config=config, num_splits=splits)
                            timings[(block_h, block_n, warps, stages, splits)] = graph_ms(timed, 2, 10, args.inner)
                        except Exception as error:  # a configuration that does not fit: skip it
                            print(f"  {config} splits={splits}: {type(error).__name__}", file=sys.stderr)
                chosen_config = backend.choose_config(args.heads, step["q"].dtype, args.head_dim)
                groups = math.ceil(args.heads / chosen_config.block_h)
                tiles = math.ceil(n_keys / chosen_config.block_n)
                chosen_splits = backend.choose_splits(batch, groups, tiles, backend._sm_count(device))
                chosen = (chosen_config.block_h, chosen_config.block_n, chosen_config.num_warps,
                          chosen_config.num_stages, None)  # fmt: skip
                best = min(timings, key=timings.get)
                label = f"{chosen[:4]} s={chosen_splits}"
                print(f"{layer:>5} {batch:>5} {context:>7} {label:>22} {timings.get(chosen, float('nan')):>8.4f} "
                      f"{str(best[:4]) + ' s=' + str(best[4]):>22} {timings[best]:>8.4f}")  # fmt: skip


def indexer_points(args, device, gen) -> None:
    """The indexer's decode op at each (batch, context): reference vs Triton, and whether they chose alike."""
    print(f"{'batch':>5} {'context':>7} {'slots':>6} {'reference ms':>12} {'triton ms':>10} {'graph ms':>9} "
          f"{'GB/s':>7} {'ratio':>7} {'same choice':>11} {'score dev':>9}")  # fmt: skip
    for batch in args.batch:
        for context in args.context:
            indexer_point(args, batch, context, device, gen)
            torch.cuda.empty_cache()


def paged_index_inputs(q, weights, keys, tables, visible, k) -> PagedIndexInputs:
    """The indexer op's inputs from one step's values (plain keys)."""
    return PagedIndexInputs(q, weights, keys, None, tables, visible)


def indexer_choice(*values):
    """``indexer_topk_decode``'s Triton backend on one step's values."""
    return indexer_backend.indexer_topk_decode_triton(paged_index_inputs(*values), values[5])


def indexer_point(args, batch: int, context: int, device, gen) -> None:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    per_block = BLOCK_TOKENS // RATIOS["csa"]
    blocks = math.ceil((context + 1) / BLOCK_TOKENS)
    values = [
        torch.randn(batch, args.index_heads, args.index_dim, device=device, generator=gen),
        torch.randn(batch, args.index_heads, device=device, generator=gen) * args.index_heads**-0.5,
        torch.randn(batch * blocks, per_block, args.index_dim, device=device, generator=gen, dtype=dtype),
        torch.randperm(batch * blocks, device=device, generator=gen).view(batch, blocks),
        torch.full((batch,), (context + 1) // RATIOS["csa"], device=device),
        args.topk,
    ]
    reference = partial(indexer_topk_decode_reference, paged_index_inputs(*values), args.topk)
    fast = partial(indexer_choice, *values)
    same = all(torch.equal(a, b) for a, b in zip(fast(), reference(), strict=True))
    exact = indexer_scores(values[0], values[1], values[2][values[3]].flatten(1, 2))
    scores = indexer_backend.indexer_scores_launch(paged_index_inputs(*values))
    seen = torch.isfinite(scores)
    score_dev = (scores[seen] - exact[seen]).abs().max().item() if seen.any() else 0.0
    reference_ms = median_ms(reference, args.warmup, args.iters)
    triton_ms = median_ms(fast, args.warmup, args.iters)
    keys = values[2].element_size() * int(values[4].sum()) * args.index_dim  # the index keys' bytes read
    copies = copied_args(values, (2,), copy_count(keys, args.cold))
    replay_ms = graph_ms(calls_over(indexer_choice, copies), args.warmup, args.iters,
                         args.inner)  # fmt: skip
    moved = keys + 4 * values[0].numel()
    gbps = moved / (replay_ms * 1e-3) / 1e9
    print(f"{batch:>5} {context:>7} {blocks * per_block:>6} {reference_ms:>12.4f} {triton_ms:>10.4f} "
          f"{replay_ms:>9.4f} {gbps:>7.0f} {reference_ms / replay_ms:>6.1f}x {str(same):>11} "
          f"{score_dev:>9.2e}")  # fmt: skip


CODED_CACHE_ARGS = (1, 2, 6, 7)
"""The window ring's and the entries' codes and scales among ``coded_step``'s values: what ``--cold`` copies."""


def coded_step(step: dict) -> list:
    """The coded op's arguments for ``step``: its window ring and entries rounded as V4.1 rounds them, then coded."""
    window_codes, window_scales = WINDOW_KV_FORMAT.encode(fake_quant_window_kv(step["window"]))
    entry_codes, entry_scales = COMPRESSED_KV_FORMAT.encode(fake_quant_compressed_kv(step["entries"]))
    head = [step["q"], window_codes, window_scales]
    tail = [step[name] for name in ("block_tables", "indices", "sink", "softmax_scale")]
    return head + [step["slots"], step["positions"], step["window_from"], entry_codes, entry_scales] + tail


def coded_points(args, device, gen) -> list[dict]:
    """The coded op at each (layer, batch, context): the reference, then every decode form of the Triton op."""
    print(f"{'layer':>5} {'batch':>5} {'context':>7} {'keys':>5} {'decode':>16} {'reference ms':>12} "
          f"{'triton ms':>10} {'graph ms':>9} {'vs twice':>8} {'ref dev':>8} {'tri dev':>8}")  # fmt: skip
    rows = []
    for layer in args.layers:
        for batch in args.batch:
            for context in args.context:
                step = make_step(args, layer, batch, context, device, gen)
                values = coded_step(step)
                exact = sparse_attention_decode_coded_reference(CodedDecodeInputs(values[0].float(), *values[1:]))
                reference = partial(sparse_attention_decode_coded_reference, CodedDecodeInputs(*values))
                reference_ms = median_ms(reference, args.warmup, args.iters)
                reference_dev = deviation(reference(), exact)
                rows_bytes = [values[i][0, 0].nbytes + values[i + 1][0, 0].nbytes for i in CODED_CACHE_ARGS[::2]]
                copies = copied_args(values, CODED_CACHE_ARGS, copy_count(cache_bytes(step, *rows_bytes), args.cold))
                timed = {}
                for form in coded_backend.DECODES:
                    call = partial(
                        coded_backend.sparse_attention_decode_coded_launch, CodedDecodeInputs(*values), decode=form
                    )
                    cycle = calls_over(coded_launch_values, copies, decode=form)
                    replay = graph_ms(cycle, args.warmup, args.iters, args.inner)
                    timed[form] = (median_ms(call, args.warmup, args.iters), replay, deviation(call(), exact))
                for form, (eager, replay, dev) in timed.items():
                    print(f"{layer:>5} {batch:>5} {context:>7} {args.window + step['indices'].shape[1]:>5} "
                          f"{form:>16} {reference_ms:>12.4f} {eager:>10.4f} {replay:>9.4f} "
                          f"{timed['twice'][1] / replay:>7.2f}x {reference_dev:>8.2e} {dev:>8.2e}")  # fmt: skip
                    rows.append({"reference_dev": reference_dev, "triton_dev": dev})
                torch.cuda.empty_cache()
    print("vs twice: the twice form's graph-replay ms / this form's. dev: max |x - fp32 reference on the same inputs|.")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_decode: needs a CUDA device", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    print(f"{torch.cuda.get_device_name(device)}; heads {args.heads} x {args.head_dim}, window {args.window}, "
          f"top-k {args.topk}, {args.dtype}")  # fmt: skip
    print(mode_line(args.cold, "indexer's keys" if args.indexer else "cache"))
    if args.sweep:
        sweep(args, device, gen)
        return 0
    if args.indexer:
        indexer_points(args, device, gen)
        return 0
    if args.coded:
        rows = coded_points(args, device, gen)
    else:
        rows = []
        for layer in args.layers:
            for batch in args.batch:
                for context in args.context:
                    rows.append(run_point(args, layer, batch, context, device, gen))
                    torch.cuda.empty_cache()
        print_table(rows)
    worst = max(r["triton_dev"] - 2 * r["reference_dev"] for r in rows)
    verdict = "ok" if worst <= 1e-2 else f"Triton deviates more than twice the reference (+{worst:.2e})"
    print(f"correctness: {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
