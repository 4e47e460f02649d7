"""V4.1 decode checked and timed on a GPU: V4.1-Flash widths, weights in release precision.

    python benchmarks/v41_decode_checks.py --experts 384 --batches 1 32 --context 256 --out OUT/v41.json

For the 4-layer V4.1 slice of :func:`dsinfer.bench.v41_slice.v41_slice_config` (window + Engram, ratio-2 source,
ratio-1 decoder source, keyless index source; random weights built on the GPU, routed experts packed FP4; the
Engram table in the model) and each decode batch:
* a decode step under ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation raises;
* the same step captured in a CUDA graph and replayed: its logits against the eager step's (bit for bit);
* ms per step, eager and replayed, and per layer (to set beside V4's, ``benchmarks/fast_path_checks.py``).
A decode step advances each sequence's Engram history, so every timed call first restores it (inside the graph
too): each run decodes the same token at the same position from the same state.

``--op-map`` needs no GPU: it counts the work of one decode step of the same 4-layer slice at tiny widths on the
CPU (``--op-map`` alone, or with ``--quantized``): every aten op that would be a kernel of its own, by the source
line that issued it, with each call of an op that has a CUDA backend beside its reference (a Triton kernel, a
built-in) counted once, as one launch, instead of the reference's ops.

The batch here prefills every sequence in one forward, which bounds the context it can reach (8 x 16,384 tokens
do not fit an H100); long contexts are timed by the engine in ``dsinfer bench sweep decode --arch v41
--flash-layers 4``, which prefills in chunks and keeps the Engram tables in host shared memory.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_path_checks import (  # noqa: E402
    PROFILE_KEYS,
    cuda_ms,
    graph_timeline,
    kernel_profile,
    pipelined_ms,
    prefill_and_decode_batch,
)

from dsinfer.bench.v41_slice import synthetic_hasher, v41_slice_config  # noqa: E402
from dsinfer.graph_capture import capture_graph  # noqa: E402
from dsinfer.kv.cache_v41 import KVCacheV41, block_tokens_for_v41  # noqa: E402
from dsinfer.models.expert_packing import weight_bytes  # noqa: E402
from dsinfer.models.native_random import build_native_model  # noqa: E402


@torch.inference_mode()
def check(model, sequences: int, context: int, quantized: bool, device, repeats: int, profile: int = 0) -> dict:
    config = model.config
    block_tokens = block_tokens_for_v41(config)
    blocks = sequences * math.ceil((context + 64) / block_tokens)
    cache = KVCacheV41(config, sequences, blocks, block_tokens, torch.bfloat16, device, quantized_storage=quantized)
    batch = prefill_and_decode_batch(model, cache, sequences, context, device)  # any cache with block_tokens
    history = cache.engram_history.clone()

    def step() -> torch.Tensor:
        cache.engram_history.copy_(history)
        return model(batch)

    eager = step()
    torch.cuda.synchronize()
    row: dict = {"requests": sequences, "context": context, "quantized_storage": quantized}
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        row["sync_free"] = True
    except RuntimeError as exc:
        row["sync_free"] = False
        row["sync_error"] = str(exc).splitlines()[0][:300]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    row["eager_ms"] = statistics.median(cuda_ms(step, repeats))
    try:
        graph, captured = capture_graph(step)
        graph.replay()
        torch.cuda.synchronize()
        row["graph_equal"] = bool(torch.equal(captured, eager))
        row["graph_max_abs_diff"] = float((captured.float() - eager.float()).abs().max())
        row["graph_ms"] = statistics.median(cuda_ms(graph.replay, repeats))
        row["graph_ms_per_layer"] = row["graph_ms"] / config.num_hidden_layers
        row["graph_pipelined_ms"] = pipelined_ms(graph.replay, repeats)
        if profile:
            row["graph_timeline"] = graph_timeline(graph.replay)
    except Exception as exc:  # report, do not hide: the row says the capture failed and why
        row["graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    if profile:
        row["profile"] = kernel_profile(step, profile)
    return row


VIEW_OPS = frozenset(
    "view _unsafe_view split split_with_sizes unsqueeze squeeze expand t transpose permute slice select alias detach "
    "as_strided unbind reshape _reshape_alias flatten unflatten empty empty_like lift_fresh lift_fresh_copy".split()
)  # metadata only: no kernel


def op_map(quantized: bool, sequences: int = 2, context: int = 100, top: int = 40) -> dict:
    """One decode step's ops on the CPU (see the module doc): totals, launches per op, the busiest source lines."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dsinfer.models.tiny import tiny_config_v41
    from dsinfer.ops import registry

    slice_layout = v41_slice_config(4, experts=8)  # the layout only: tiny_config_v41 sets the widths
    config = tiny_config_v41(
        **{name: getattr(slice_layout, name) for name in ("num_hidden_layers", "compress_ratios",
           "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id", "engram_layer_ids")},
        num_nextn_predict_layers=0, dspark_target_layer_ids=(1, 2, 3), candidate_topk_blocks=4, index_topk=16,
        engram_num_embeddings=(),
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_native_model(config, torch.bfloat16, torch.device("cpu"))
    model.attach_engram_hasher(synthetic_hasher(config))
    block_tokens = block_tokens_for_v41(config)
    blocks = sequences * math.ceil((context + 64) / block_tokens)
    cache = KVCacheV41(config, sequences, blocks, block_tokens, torch.bfloat16, "cpu", quantized_storage=quantized)
    batch = prefill_and_decode_batch(model, cache, sequences, context, "cpu")
    registry.backends("rope")  # loads every op
    fast = {}
    for op, backends in registry._REGISTRY.items():
        if any(b.name != registry.REFERENCE and "cuda" in b.devices for b in backends.values()):
            code = backends[registry.REFERENCE].fn.__code__
            fast[(code.co_filename, code.co_name)] = op

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops, self.launches, self.calls = collections.Counter(), collections.Counter(), []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in VIEW_OPS:
                frame, call, where = sys._getframe(), None, None
                while frame is not None:
                    code = frame.f_code
                    if (code.co_filename, code.co_name) in fast:
                        call = frame  # the outermost reference with a CUDA backend
                    if where is None and "/dsinfer/" in code.co_filename:
                        where = f"{code.co_filename.split('/dsinfer/')[-1]}:{frame.f_lineno} {code.co_name}"
                    frame = frame.f_back
                if call is None:
                    self.ops[(where or "?", name)] += 1
                elif not any(seen is call for seen in self.calls):
                    self.calls.append(call)
                    self.launches[fast[(call.f_code.co_filename, call.f_code.co_name)]] += 1
            return func(*args, **(kwargs or {}))

    with torch.inference_mode():
        counter = Count()
        with counter:
            model(batch)
    lines = collections.Counter()
    for (where, _), count in counter.ops.items():
        lines[where] += count
    torch_ops, launches = sum(counter.ops.values()), sum(counter.launches.values())
    return {"quantized_storage": quantized, "torch_ops": torch_ops, "backend_calls": launches,
            "total": torch_ops + launches, "backend_calls_by_op": dict(counter.launches.most_common()),
            "busiest_lines": [f"{count} {where}" for where, count in lines.most_common(top)]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=384, help="routed experts per layer (V4.1-Flash: 384)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="kernel profile of each eager step, listing its TOP costliest kernels")  # fmt: skip
    parser.add_argument(
        "--fp8-linears",
        choices=["dequantize", "keep"],
        default="dequantize",
        help="the release's FP8 linears as bf16 (as served on Hopper) or kept as codes and scales",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--op-map", action="store_true", help="count one decode step's ops on the CPU (no GPU)")
    parser.add_argument("--quantized", action="store_true", help="--op-map with FP8 / FP4 cache storage")
    args = parser.parse_args()
    if args.op_map:
        print(json.dumps(op_map(args.quantized), indent=1))
        return
    device = torch.device("cuda")
    config = v41_slice_config(4, args.experts)
    model = build_native_model(config, torch.bfloat16, device, fp8_linears=args.fp8_linears)
    model.attach_engram_hasher(synthetic_hasher(config))
    result = {"device": torch.cuda.get_device_name(device), "layers": config.num_hidden_layers,
              "experts": args.experts, "weight_gib": weight_bytes(model)["all"] / 2**30, "rows": []}  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    for quantized in (False, True):
        for sequences in args.batches:
            result["rows"].append(check(model, sequences, args.context, quantized, device, args.repeats))
            print(json.dumps(result["rows"][-1]), flush=True)
    if args.profile:  # after every timing: graphs replayed after a profiler session ran slower (fast_path_checks)
        for row in result["rows"]:
            profiled = check(model, row["requests"], args.context, row["quantized_storage"], device, 1, args.profile)
            row.update({key: profiled[key] for key in PROFILE_KEYS if key in profiled})
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
