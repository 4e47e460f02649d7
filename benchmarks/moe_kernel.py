"""Routed-experts op on one GPU: the Triton FP4 kernels against the reference and torch's bf16 grouped GEMM.

    python benchmarks/moe_kernel.py                       # V4-Flash widths, T = 1 32 1024 4096
    python benchmarks/moe_kernel.py --tokens 1 32 --backends triton triton-graph
    python benchmarks/moe_kernel.py --sweep                # time candidate block configurations (graph replay)
    python benchmarks/moe_kernel.py --decode-gemv          # T = 1 2: the GEMV path against the grouped kernels
    python benchmarks/moe_kernel.py --decode-gemv --sweep  # time GEMV_SWEEP_CONFIGS (graph replay)
    python benchmarks/moe_kernel.py --decode-gemv --cold   # each call on its own copy of the experts: none in L2

Random experts at V4-Flash widths (hidden 4096, intermediate 2048, 256 experts, top-6), FP4 packed with ue8m0
scales as the checkpoint stores them; the dense bf16 experts are their exact dequantisation, so every backend
computes the same function. Routing is a random top-k (distinct experts per token, roughly uniform load).

Backends:

* ``triton``: ``dsinfer.ops.moe.triton`` on the packed FP4 experts;
* ``triton-graph``: the same, captured once in a CUDA graph and replayed (it fails if the op synchronises);
* ``triton-dense``: the same kernels on the dense bf16 experts;
* ``reference``: the torch reference (dequantise each used expert, then per-expert ``F.linear``; it reads the
  expert counts on the host);
* ``grouped_mm``: ``torch._grouped_mm`` on the dense bf16 experts.

``--sweep`` instead times every candidate ``KernelConfig`` of ``SWEEP_CONFIGS`` for the FP4 path, captured in a
CUDA graph, and the routing layout alone (one fused launch against the torch ops); the winners are what
``dsinfer.ops.moe.triton.choose_config`` hard-codes by slots per expert.

``--decode-gemv`` times, per token count (default 1 and 2), the GEMV path of ``dsinfer.ops.moe.decode_triton``
against the grouped kernels, both captured in a CUDA graph, checks both against the reference and lists each
path's kernels with their mean device time (torch.profiler over eager calls); with
``--sweep`` it times ``GEMV_SWEEP_CONFIGS`` instead (the down launch's with each of ``GEMV_SWEEP_DOWN_SPLITS``;
``--gemv-parts`` picks the launches): each kernel's candidates with the other kernel at its default, then the
winners together (what to write into ``DECODE_GEMV_CONFIG``). Its rows give the milliseconds a call, the expert
bytes a call reads (every slot's expert for the GEMV, each distinct expert once for the grouped kernels) and the
TB/s that implies. By default each replay of a graph runs the op once on the same experts, so what L2 kept of
them from the previous replay is not read from HBM again (a model's step never finds an expert in L2). With
``--cold`` a replay runs the op once on each of as many copies of the packed experts and their scales as make the
touched experts' bytes add up to 256 MiB a cycle (``cold_copies.py``): every call reads its experts from HBM
(the profiled eager calls take the copies in turn too).
The copies are of every expert (the grouped kernels' launch depends on the number of experts), so they take
about ``ceil(256 MiB / touched bytes)`` times the FP4 experts' size in memory (about 13 GiB at V4-Flash widths
and one token).

For each token count: the median over ``--iters`` timed calls (CUDA events) after ``--warmup`` calls, the weight
bytes of the experts the step touches in the form the backend reads (FP4 + scales, or bf16), the effective
GB/s that gives, and the largest deviation from the reference in bf16 relative to the reference's largest value.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from functools import partial

import torch
from cold_copies import calls_over, copy_count, cycle_graph, mode_line  # --cold's copies and graphs (same folder)

BACKENDS = ("triton", "triton-graph", "triton-dense", "reference", "grouped_mm")

SWEEP_CONFIGS = {
    "decode": [  # few slots per expert: (block_m, block_n, block_k, num_warps, num_stages, swap_ab, columns_first,
        # split_k)
        (16, 64, 128, 4, 4, False, True),
        (16, 64, 128, 4, 4, False, True, 2),
        (16, 64, 128, 4, 4, False, True, 4),
        (16, 64, 128, 4, 4, False, False),
        (16, 32, 128, 4, 4, False, True),
        (16, 64, 64, 4, 4, False, True),
        (16, 128, 64, 4, 4, False, True),
        (16, 64, 128, 8, 4, False, True),
        (16, 32, 256, 4, 3, False, True),
    ],
    "prefill": [  # tens of slots per expert and more
        (32, 64, 128, 4, 3, False, True),
        (32, 64, 64, 4, 4, False, True),
        (64, 64, 64, 4, 4, False, True),
        (128, 128, 64, 8, 3, False, True),
        (128, 64, 64, 4, 4, False, True),
        (128, 64, 64, 4, 4, False, False),
        (128, 64, 64, 4, 3, False, True),
        (128, 64, 64, 4, 5, False, True),
        (128, 32, 64, 4, 4, False, True),
        (128, 64, 32, 4, 4, False, True),
        (128, 64, 128, 4, 3, False, True),
        (64, 128, 64, 4, 4, False, True),
        (128, 64, 64, 8, 4, False, True),
        (256, 64, 64, 8, 4, False, True),
    ],
}
"""Candidates per regime: ``decode`` for under 4 slots per expert, ``prefill`` above."""

GEMV_SWEEP_CONFIGS = {
    # (block_n, block_k, num_warps, num_stages); programs at T = 1 are 6 * 2048 / block_n (gate/up) and
    # 4096 / block_n (down). Past block_k = 256 * num_warps Triton converts each step's activations through
    # shared memory (a barrier per plane): cheap with one or two warps. On the H200 (Triton 3.6) smaller programs,
    # more of them, were faster at one token: (16, 512, 2, 1) and (8, 512, 1, 1) beat the four-warp launches
    # (docs/perf.md, history, pass 7), so the candidates go below them too.
    "gate_up": [
        (16, 512, 2, 1),
        (32, 512, 4, 1),
        (16, 256, 2, 1),
        (16, 512, 1, 1),
        (8, 512, 1, 1),
        (8, 256, 1, 1),
        (16, 256, 1, 1),
        (8, 1024, 1, 1),
        (8, 512, 2, 1),
        (4, 512, 1, 1),
    ],
    "down": [
        (8, 512, 1, 1),
        (16, 512, 4, 1),
        (16, 512, 2, 1),
        (4, 512, 1, 1),
        (8, 256, 1, 1),
        (4, 256, 1, 1),
        (8, 1024, 1, 1),
        (16, 512, 1, 1),
        (2, 512, 1, 1),
    ],
}
"""Candidate launches of the two GEMV kernels (``--decode-gemv --sweep``)."""

GEMV_SWEEP_DOWN_SPLITS = (1, 2, 3, 6)
"""Candidate splits of a token's slots for each down launch (``DecodeGemvConfig.down_splits``)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 1024, 4096], help="tokens per step (T)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size H (multiple of 32)")
    parser.add_argument("--inter", type=int, default=2048, help="expert intermediate size I (multiple of 32)")
    parser.add_argument("--experts", type=int, default=256, help="routed experts E")
    parser.add_argument("--top-k", type=int, default=6, help="experts per token k")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--reference-iters", type=int, default=3, help="timed calls of the (slow) reference")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sweep", action="store_true", help="time SWEEP_CONFIGS instead of the backends")
    parser.add_argument(
        "--gemv-parts",
        nargs="+",
        choices=("gate_up", "down"),
        default=["gate_up", "down"],
        help="with --decode-gemv --sweep: the launches to sweep (the others keep their defaults)",
    )
    parser.add_argument("--decode-gemv", action="store_true",
                        help="the GEMV path against the grouped kernels (T = 1 2 unless --tokens)")  # fmt: skip
    parser.add_argument("--cold", action="store_true",
                        help="with --decode-gemv: calls cycle through copies of the experts (none in L2)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.cold and not args.decode_gemv:
        parser.error("--cold applies to --decode-gemv")
    if args.decode_gemv and "--tokens" not in (argv if argv is not None else sys.argv[1:]):
        args.tokens = [1, 2]
    if args.hidden % 32 or args.inter % 32:
        parser.error("--hidden and --inter must be multiples of 32 (one FP4 scale per 32 inputs)")
    if not 1 <= args.top_k <= args.experts:
        parser.error("--top-k must lie in 1 .. --experts")
    if min(args.tokens) < 1 or args.warmup < 0 or args.iters < 1 or args.reference_iters < 1:
        parser.error("--tokens and --iters must be positive, --warmup non-negative")
    return args


def random_fp4_experts(experts: int, hidden: int, inter: int, device: torch.device, gen: torch.Generator):
    """Packed e2m1 bytes and ue8m0 scales near 2**-6 (so the products stay in bf16's comfortable range)."""
    from dsinfer.ops.moe import ExpertWeights

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)

    def scales(*shape):
        return torch.randint(119, 124, shape, dtype=torch.uint8, device=device, generator=gen)

    return ExpertWeights(
        codes(experts, 2 * inter, hidden // 2),
        scales(experts, 2 * inter, hidden // 32),
        codes(experts, hidden, inter // 2),
        scales(experts, hidden, inter // 32),
        inter,
        True,
    )


def random_step(args: argparse.Namespace, tokens: int, device: torch.device, gen: torch.Generator):
    """A step's bf16 activations [tokens, H], top-k expert ids of random scores and positive routing weights."""
    scores = torch.rand(tokens, args.experts, device=device, generator=gen)
    expert_ids = torch.topk(scores, args.top_k, dim=-1).indices
    expert_weights = torch.rand(tokens, args.top_k, device=device, generator=gen) + 0.1
    x = torch.randn(tokens, args.hidden, device=device, generator=gen).bfloat16()
    return x, expert_ids, expert_weights


def dense_copy(weights, dtype: torch.dtype):
    """The exact dequantisation of every expert, stacked in the dense layout."""
    from dsinfer.ops.moe import ExpertWeights, dequantize_expert

    pairs = [dequantize_expert(weights, e, dtype) for e in range(weights.num_experts)]
    return ExpertWeights(
        torch.stack([w13 for w13, _ in pairs]), None, torch.stack([w2 for _, w2 in pairs]), None,
        weights.intermediate_size, False,
    )  # fmt: skip


def time_calls(fn, warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls, each timed with its own CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def graphed(fn, warmup: int):
    """``fn`` captured in a CUDA graph after ``warmup`` eager calls (Triton compiles outside the capture)."""
    graph, _, out = cycle_graph(fn, 1, warmup)
    return graph, out


def expert_copies(fp4, copies: int, made: list) -> list:
    """``copies`` sets of experts: ``fp4`` and clones of its packed experts and scales (kept in ``made``, which
    starts as ``[fp4]``, for the next token count)."""
    while len(made) < copies:
        made.append(replace(fp4, w13=fp4.w13.clone(), w13_scale=fp4.w13_scale.clone(), w2=fp4.w2.clone(),
                            w2_scale=fp4.w2_scale.clone()))  # fmt: skip
    return made[:copies]


def sweep(args: argparse.Namespace, fp4, gen: torch.Generator, limit: float) -> None:
    """Graph-replayed median of every candidate configuration per token count, then the routing layout alone."""
    from dsinfer.ops.moe import align_slots, sort_slots
    from dsinfer.ops.moe.reference import routed_moe_reference
    from dsinfer.ops.moe.triton import KernelConfig, align_slots_fused, choose_config, routed_moe_triton

    device = fp4.w13.device
    print("| T | config | graph ms | max dev / max ref |")
    print("| ---: | --- | ---: | ---: |")
    for tokens in args.tokens:
        x, expert_ids, expert_weights = random_step(args, tokens, device, gen)
        reference = routed_moe_reference(x, fp4, expert_ids, expert_weights, limit).float()
        ref_max = float(reference.abs().max())
        slots = tokens * args.top_k
        regime = "decode" if slots / args.experts < 4 else "prefill"
        chosen = choose_config(slots, args.experts)
        results = []
        for candidate in SWEEP_CONFIGS[regime]:
            config = KernelConfig(*candidate)
            try:
                fn = partial(routed_moe_triton, x, fp4, expert_ids, expert_weights, limit, config=config)
                graph, out = graphed(fn, args.warmup)
                ms = time_calls(graph.replay, args.warmup, args.iters)
            except Exception as error:  # a configuration that does not compile or fit is a row, not the end
                print(f"| {tokens} | {tuple(config)} | failed: {type(error).__name__}: {str(error)[:80]} | |")
                continue
            deviation = float((out.float() - reference).abs().max()) / max(ref_max, 1e-30)
            results.append((ms, tuple(config)))
            mark = " (chosen)" if config == chosen else ""
            print(f"| {tokens} | {tuple(config)}{mark} | {ms:.3f} | {deviation:.2e} |", flush=True)
            del graph, out
        if results:
            print(f"| {tokens} | best {min(results)[1]} | {min(results)[0]:.3f} | |", flush=True)
        if slots <= 1024:
            block_m = chosen[0]
            layouts = {
                "fused": partial(align_slots_fused, expert_ids, args.experts, block_m),
                "torch": lambda ids=expert_ids, m=block_m: align_slots(sort_slots(ids, args.experts), m),
            }
            for name, fn in layouts.items():
                graph, _ = graphed(fn, args.warmup)
                print(f"| {tokens} | routing {name} | {time_calls(graph.replay, args.warmup, args.iters):.4f} | |")


def _timed_row(args: argparse.Namespace, tokens: int, label: str, fns, gigabytes: float, reference) -> float | None:
    """Print one table row for ``fns`` (one call, or one a copy of the experts) in a CUDA graph: median ms a call,
    the GB a call reads, the TB/s that gives and the deviation from ``reference``."""
    try:
        graph, calls, out = cycle_graph(fns, 1, args.warmup)
        ms = time_calls(graph.replay, args.warmup, args.iters) / calls
    except Exception as error:  # a launch that does not compile or fit is a row, not the end
        print(f"| {tokens} | {label} | failed: {type(error).__name__}: {str(error)[:80]} | | | |", flush=True)
        return None
    deviation = float((out.float() - reference).abs().max()) / max(float(reference.abs().max()), 1e-30)
    print(f"| {tokens} | {label} | {ms:.4f} | {gigabytes:.4f} | {gigabytes / ms:.2f} | {deviation:.2e} |",
          flush=True)  # fmt: skip
    return ms


def _kernel_rows(args: argparse.Namespace, tokens: int, label: str, fns: list) -> None:
    """Print each device kernel of ``fns`` (taken in turn) with its mean time over ``--iters`` eager calls
    (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fns[0]()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as recorded:
        for call in range(args.iters):
            fns[call % len(fns)]()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in recorded.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time_total / 1e3
    for name, total_ms in sorted(kernels.items(), key=lambda item: -item[1]):
        print(f"| {tokens} | {label} kernel {name[:60]} | {total_ms / args.iters:.4f} | | | |", flush=True)


def decode_gemv(args: argparse.Namespace, fp4, gen: torch.Generator, limit: float) -> None:
    """The GEMV path against the grouped kernels per token count (graph replay), or the GEMV launch sweep."""
    from dsinfer.ops.moe.decode_triton import GemvConfig, decode_gemv_config, routed_moe_decode_gemv
    from dsinfer.ops.moe.reference import routed_moe_reference
    from dsinfer.ops.moe.triton import routed_moe_triton

    device = fp4.w13.device
    per_expert = fp4.nbytes / args.experts
    made = [fp4]  # --cold's copies of the experts, kept from one token count to the next
    print(mode_line(args.cold, "packed FP4 experts and scales"))
    print("| T | path / launch | ms a call | weight GB a call | TB/s | max dev / max ref |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for tokens in args.tokens:
        x, expert_ids, expert_weights = random_step(args, tokens, device, gen)
        reference = routed_moe_reference(x, fp4, expert_ids, expert_weights, limit).float()
        # The GEMV reads every slot's expert; the grouped kernels each distinct expert once.
        slots_gb = expert_ids.numel() * per_expert / 1e9
        touched_gb = int(torch.unique(expert_ids).numel()) * per_expert / 1e9
        experts = expert_copies(fp4, copy_count(touched_gb * 1e9, args.cold), made)
        if args.cold:
            print(f"| {tokens} | {len(experts)} copies of the experts, {len(experts) * touched_gb:.3f} GB touched a "
                  f"cycle | | | | |", flush=True)  # fmt: skip
        steps = [[x, each, expert_ids, expert_weights, limit] for each in experts]  # one a copy of the experts
        if not args.sweep:
            grouped = calls_over(routed_moe_triton, steps, gemv=False)
            gemv = calls_over(routed_moe_decode_gemv, steps)
            _timed_row(args, tokens, "grouped", grouped, touched_gb, reference)
            _timed_row(args, tokens, f"gemv {describe(decode_gemv_config(args.inter))}", gemv, slots_gb, reference)
            _kernel_rows(args, tokens, "grouped", grouped)  # eager: per-kernel device time, no launch gaps
            _kernel_rows(args, tokens, "gemv", gemv)
            continue
        default = decode_gemv_config(args.inter)
        best = {}
        for part in args.gemv_parts:
            results = []
            splits = GEMV_SWEEP_DOWN_SPLITS if part == "down" else (default.down_splits,)
            for candidate in GEMV_SWEEP_CONFIGS[part]:
                for down_splits in splits:
                    config = default._replace(**{part: GemvConfig(*candidate)}, down_splits=down_splits)
                    fns = calls_over(routed_moe_decode_gemv, steps, config=config)
                    ms = _timed_row(args, tokens, f"{part} {describe(config)}", fns, slots_gb, reference)
                    if ms is not None:
                        results.append((ms, config))
            if not results:
                continue
            fastest = min(results)[1]
            if part == "gate_up":
                best["gate_up"] = fastest.gate_up
            else:
                best.update(down=fastest.down, down_splits=fastest.down_splits)
        config = default._replace(**best)
        fns = calls_over(routed_moe_decode_gemv, steps, config=config)
        _timed_row(args, tokens, f"best {describe(config)}", fns, slots_gb, reference)


def describe(config) -> str:
    """A decode GEMV configuration as a table cell: both launches and the down launch's splits."""
    return f"{tuple(config.gate_up)} {tuple(config.down)} x{config.down_splits}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_kernel.py needs a CUDA device", file=sys.stderr)
        return 2
    from dsinfer.ops.moe.grouped_mm import routed_moe_grouped_mm
    from dsinfer.ops.moe.reference import routed_moe_reference
    from dsinfer.ops.moe.triton import routed_moe_triton

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    fp4 = random_fp4_experts(args.experts, args.hidden, args.inter, device, gen)
    dense = dense_copy(fp4, torch.bfloat16)
    limit = 10.0
    fp4_per_expert, dense_per_expert = fp4.nbytes / args.experts, dense.nbytes / args.experts
    sizes = f"FP4 experts {fp4.nbytes / 2**30:.2f} GiB, bf16 {dense.nbytes / 2**30:.2f} GiB"
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; H={args.hidden} I={args.inter} "
          f"E={args.experts} k={args.top_k}; {sizes}")  # fmt: skip
    if args.decode_gemv:
        decode_gemv(args, fp4, gen, limit)
        return 0
    if args.sweep:
        sweep(args, fp4, gen, limit)
        return 0
    print("| T | backend | median ms | experts touched | weight GB read | GB/s | max dev / max ref |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for tokens in args.tokens:
        x, expert_ids, expert_weights = random_step(args, tokens, device, gen)
        touched = int(torch.unique(expert_ids).numel())
        reference = routed_moe_reference(x, fp4, expert_ids, expert_weights, limit).float()
        ref_max = float(reference.abs().max())
        step = (expert_ids, expert_weights, limit)
        runs = {
            "triton": (partial(routed_moe_triton, x, fp4, *step), fp4_per_expert),
            "triton-dense": (partial(routed_moe_triton, x, dense, *step), dense_per_expert),
            "reference": (partial(routed_moe_reference, x, fp4, *step), fp4_per_expert),
            "grouped_mm": (partial(routed_moe_grouped_mm, x, dense, *step), dense_per_expert),
        }
        for name in args.backends:
            if name == "triton-graph":
                torch.cuda.set_sync_debug_mode("error")  # a host synchronisation in the op fails here
                try:
                    graph, out = graphed(runs["triton"][0], args.warmup)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                fn, per_expert = graph.replay, fp4_per_expert
            else:
                fn, per_expert = runs[name]
                out = fn()
            iters = args.reference_iters if name == "reference" else args.iters
            ms = time_calls(fn, args.warmup, iters)
            deviation = float((out.float() - reference).abs().max()) / max(ref_max, 1e-30)
            gigabytes = touched * per_expert / 1e9
            print(f"| {tokens} | {name} | {ms:.3f} | {touched} | {gigabytes:.3f} | {gigabytes / (ms / 1e3):.0f} "
                  f"| {deviation:.2e} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
