"""The forward as tensors, checked and timed on a GPU: V4-Flash widths, weights in release precision.

    python benchmarks/fast_path_checks.py --layers 4 --out OUT/checks.json
    python benchmarks/fast_path_checks.py --layers 4 --fit-layers --cache-gib 16   # also the deepest model that fits

For the ``--layers`` slice (random weights built on the GPU: packed FP4 experts, the rest bf16):
* weight bytes against the bytes the release checkpoint stores for the same tensors;
* a decode step (``--decode-batch`` sequences at ``--context`` tokens) under
  ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation in the forward raises;
* the same step captured in a CUDA graph and replayed: its logits against the eager step's;
* prefill of one sequence of each ``--prefill-tokens`` and decode ms/step (eager and graph) for 1 and 32 requests;
* ``--long-decode 256:4096``: decode points of many requests at a long context (eager and graph ms/step);
* ``--profile``: the device kernels of one eager decode step and one prefill (count, busy time, the costliest),
  so a step's time can be set against the sum of its kernels. Profiles are taken after every point is timed:
  graphs replayed after a profiler session in the same process ran measurably slower on the H200 (docs/perf.md,
  history, pass 11).
With ``--fit-layers``: the most V4-Flash layers whose weights fit beside a ``--cache-gib`` cache, built,
cache allocated, decode timed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import replace

import torch

from dsinfer.bench.shapes import flash_slice_config
from dsinfer.bench.step_profile import profiled_spans, timeline_summary
from dsinfer.config import ModelConfig, QuantizationConfig
from dsinfer.graph_capture import capture_graph
from dsinfer.kv.batch import PackedBatch, SequenceSpan, host_to_device
from dsinfer.kv.cache_v4 import KVCache, attention_layer_ratios, block_tokens_for
from dsinfer.models.deepseek_v4 import DeepseekV4
from dsinfer.models.expert_packing import weight_bytes
from dsinfer.models.native_random import build_native_model
from dsinfer.models.tiny import storage_format

BYTES = {"bf16": 2, "fp32": 4, "int": 4}
PROFILE_KEYS = ("graph_timeline", "profile")  # what a profiled pass adds to a timed row


def release_checkpoint_bytes(config: ModelConfig) -> int:
    """Bytes the release formats store for this config's tensors (FP8 128x128 + scales, FP4 + per-32 scales)."""
    config = replace(config, quantization=QuantizationConfig())
    with torch.device("meta"):
        model = DeepseekV4(config, with_mtp=False)
    total = 0
    for name, tensor in model.state_dict().items():
        kind = storage_format(name, config)
        if kind == "fp8":
            rows, cols = tensor.shape
            total += tensor.numel() + math.ceil(rows / 128) * math.ceil(cols / 128)
        elif kind == "fp4":
            total += tensor.numel() // 2 + tensor.numel() // 32
        else:
            total += tensor.numel() * BYTES[kind]
    return total


def cuda_ms(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def pipelined_ms(fn, repeats: int) -> float:
    """Mean device time of ``repeats`` calls of ``fn`` issued back to back (one sync at the end): each call's launch
    overlaps the previous call's kernels, so a graph replay's launch latency, which :func:`cuda_ms` includes,
    drops out (what an engine that queues its next step before the current one ends pays)."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def fresh_cache(config: ModelConfig, sequences: int, context: int, device, blocks: int | None = None) -> KVCache:
    block_tokens = block_tokens_for(config)
    per_sequence = math.ceil((context + 64) / block_tokens)
    count = blocks if blocks is not None else sequences * per_sequence
    return KVCache(
        config, attention_layer_ratios(config, False), sequences, count, block_tokens, torch.bfloat16, device
    )


def prefill_and_decode_batch(model, cache: KVCache, sequences: int, context: int, device) -> PackedBatch:
    """Fill ``sequences`` prompts of ``context`` tokens, then return the batch of their next decode step."""
    per_sequence = math.ceil((context + 64) / cache.block_tokens)
    tables = [list(range(s * per_sequence, (s + 1) * per_sequence)) for s in range(sequences)]
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for start in range(0, sequences, 8):  # prefill in groups to bound activation memory
        group = range(start, min(sequences, start + 8))
        ids = torch.randint(0, vocab, (len(group) * context,), generator=generator).tolist()
        spans = [SequenceSpan(0, context, s, tables[s]) for s in group]
        positions = [p for _ in group for p in range(context)]
        batch = PackedBatch(host_to_device(ids, torch.long, device), host_to_device(positions, torch.long, device),
                            spans, cache)  # fmt: skip
        model(batch, logits_for=batch.device_spans.token_rows)
    ids = torch.randint(0, vocab, (sequences,), generator=generator).tolist()
    spans = [SequenceSpan(context, 1, s, tables[s]) for s in range(sequences)]
    batch = PackedBatch(host_to_device(ids, torch.long, device),
                        host_to_device([context] * sequences, torch.long, device), spans, cache)  # fmt: skip
    _ = batch.device_spans  # built before the step: the step itself must not touch the host
    return batch


def kernel_profile(fn, top: int = 25) -> dict:
    """Device kernels of one call of ``fn`` (after a warm call): count, summed time, the ``top`` costliest names."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time_total / 1e3)
    rows = sorted(((sum(t), len(t), name) for name, t in kernels.items()), reverse=True)
    return {
        "kernels": sum(len(t) for t in kernels.values()),
        "busy_ms": sum(r[0] for r in rows),
        "top": [{"ms": round(ms, 4), "calls": calls, "name": name[:140]} for ms, calls, name in rows[:top]],
    }


def graph_timeline(replay, top: int = 10) -> dict:
    """Where a replayed CUDA graph's time goes: its kernels' summed time (``busy_ms``), the span from the first
    kernel's start to the last one's end, the idle time between kernels, and the ``top`` largest gaps with the
    kernels on either side (:func:`~dsinfer.bench.step_profile.timeline_summary`). The profiler sees each kernel
    of a replay; the graph's own timing is ``graph_ms``."""
    replay()
    torch.cuda.synchronize()
    return timeline_summary(profiled_spans(replay, torch.device("cuda")), steps=1, top=top, gaps_listed=top)


def decode_checks(
    model, config, sequences: int, context: int, device, repeats: int, profile: bool = False, top: int = 25
) -> dict:
    cache = fresh_cache(config, sequences, context, device)
    batch = prefill_and_decode_batch(model, cache, sequences, context, device)
    torch.cuda.synchronize()
    eager = model(batch)
    row: dict = {"requests": sequences, "context": context}
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(batch)
        row["sync_free"] = True
    except RuntimeError as exc:
        row["sync_free"] = False
        row["sync_error"] = str(exc).splitlines()[0][:300]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    row["eager_ms"] = statistics.median(cuda_ms(lambda: model(batch), repeats))
    try:
        graph, captured = capture_graph(lambda: model(batch))
        graph.replay()
        torch.cuda.synchronize()
        row["graph_max_abs_diff"] = float((captured - eager).abs().max())
        row["graph_equal"] = bool(torch.equal(captured, eager))
        row["graph_ms"] = statistics.median(cuda_ms(graph.replay, repeats))
        row["graph_pipelined_ms"] = pipelined_ms(graph.replay, repeats)
        if profile:
            row["graph_timeline"] = graph_timeline(graph.replay)
    except Exception as exc:  # report, do not hide: the row says the capture failed and why
        row["graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    if profile:
        row["profile"] = kernel_profile(lambda: model(batch), top)
    return row


def prefill_point(model, tokens: int, device, repeats: int, profile: bool = False, top: int = 25) -> dict:
    cache = fresh_cache(model.config, 1, tokens, device)
    ids = host_to_device([(7 * i) % model.config.vocab_size for i in range(tokens)], torch.long, device)
    positions = host_to_device(list(range(tokens)), torch.long, device)
    table = list(range(cache.num_blocks))

    def run() -> None:
        model(PackedBatch(ids, positions, [SequenceSpan(0, tokens, 0, table)], cache), logits_for=positions[-1:])

    run()
    row = {"tokens": tokens, "ms": statistics.median(cuda_ms(run, repeats))}
    row["tokens_per_s"] = tokens / row["ms"] * 1e3
    if profile:
        row["profile"] = kernel_profile(run, top)
    return row


def fit_layers(cache_gib: float, device, repeats: int, context: int) -> dict:
    """The deepest V4-Flash model (release ratios) whose weights fit beside a ``cache_gib`` cache."""
    full = ModelConfig()
    probe = build_native_model(replace(flash_slice_config(2), compress_ratios=(4, 128)), torch.bfloat16, device)
    shared = sum(t.numel() * t.element_size() for t in (probe.embed.weight, probe.head.weight))
    per_layer = (weight_bytes(probe)["all"] - shared) / 2  # a CSA and an HCA layer: the larger kinds
    del probe
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    budget = free - shared - cache_gib * 2**30 - 8 * 2**30  # embedding and head, activations, allocator slack
    layers = min(full.num_hidden_layers, int(budget // per_layer))
    config = replace(full, num_hidden_layers=layers, compress_ratios=full.compress_ratios[:layers],
                     num_nextn_predict_layers=0)  # fmt: skip
    start = time.perf_counter()
    model = build_native_model(config, torch.bfloat16, device)
    torch.cuda.synchronize()
    row = {"layers": layers, "of": full.num_hidden_layers, "build_s": time.perf_counter() - start,
           "weight_gib": weight_bytes(model)["all"] / 2**30}  # fmt: skip
    probe_cache = fresh_cache(config, 0, context, "meta", blocks=0)
    blocks = int(cache_gib * 2**30 // probe_cache.block_bytes())
    sequences = 8
    cache = fresh_cache(config, sequences, context, device, blocks=blocks)
    row["cache_gib"] = sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in [layer.window, *(getattr(c, f) for c in (layer.compressor, layer.indexer) if c is not None
                                  for f in ("pending_values", "pending_gates", "entries"))]
    ) / 2**30  # fmt: skip
    batch = prefill_and_decode_batch(model, cache, sequences, context, device)
    row["decode_requests"], row["decode_context"] = sequences, context
    row["decode_ms"] = statistics.median(cuda_ms(lambda: model(batch), repeats))
    graph, _ = capture_graph(lambda: model(batch))
    row["decode_graph_ms"] = statistics.median(cuda_ms(graph.replay, repeats))
    row["gpu_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--fit-layers", action="store_true")
    parser.add_argument("--cache-gib", type=float, default=16.0)
    parser.add_argument("--long-decode", nargs="*", default=[], metavar="REQUESTS:CONTEXT",
                        help="more decode points, e.g. 256:4096")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="kernel profile of each decode and prefill point")
    parser.add_argument("--profile-top", type=int, default=25, help="costliest kernels listed per profile")
    parser.add_argument(
        "--fp8-linears",
        choices=["dequantize", "keep"],
        default="dequantize",
        help="the release's FP8 linears as bf16 (as served on Hopper) or kept as codes and scales",
    )
    parser.add_argument("--out")
    args = parser.parse_args()
    try:
        long_points = [tuple(int(v) for v in point.split(":")) for point in args.long_decode]
        assert all(len(p) == 2 and min(p) > 0 for p in long_points)
    except (ValueError, AssertionError):
        parser.error(f"--long-decode takes REQUESTS:CONTEXT pairs of positive integers, got {args.long_decode}")
    if not torch.cuda.is_available():
        raise SystemExit("fast_path_checks needs a CUDA device")
    device = torch.device("cuda")
    torch.manual_seed(0)
    results: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    config = flash_slice_config(args.layers)
    model = build_native_model(config, torch.bfloat16, device, fp8_linears=args.fp8_linears)
    loaded = weight_bytes(model)
    stored = release_checkpoint_bytes(config)
    results["weights"] = {**loaded, "release_checkpoint": stored, "ratio_all": loaded["all"] / stored}
    results["ops"] = model.layers[0].ffn.ops.describe()
    with torch.inference_mode():
        points = [(b, args.context) for b in args.decode_batches] + long_points
        results["decode"] = []
        for sequences, context in points:
            results["decode"].append(decode_checks(model, config, sequences, context, device, args.repeats))
            print(json.dumps(results["decode"][-1]), flush=True)
            torch.cuda.empty_cache()
        results["prefill"] = [prefill_point(model, t, device, args.repeats) for t in args.prefill_tokens]
        if args.profile:  # after every timing: graphs replayed after a profiler session run slower (pass 11)
            for row, (sequences, context) in zip(results["decode"], points, strict=True):
                profiled = decode_checks(model, config, sequences, context, device, 1, True, args.profile_top)
                row.update({key: profiled[key] for key in PROFILE_KEYS if key in profiled})
                torch.cuda.empty_cache()
            for row, tokens in zip(results["prefill"], args.prefill_tokens, strict=True):
                row["profile"] = prefill_point(model, tokens, device, 1, True, args.profile_top)["profile"]
        del model
        torch.cuda.empty_cache()
        if args.fit_layers:
            results["fit"] = fit_layers(args.cache_gib, device, args.repeats, 1024)
    print(json.dumps(results, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
