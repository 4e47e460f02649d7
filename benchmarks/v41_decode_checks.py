"""V4.1 decode checked and timed on a GPU: V4.1-Flash widths, weights in release precision.

    python benchmarks/v41_decode_checks.py --experts 384 --batches 1 32 --context 256 --out OUT/v41.json

For the 4-layer V4.1 slice of ``benchmarks/ced_drift_v41.py`` (window + Engram, ratio-2 source, ratio-1 decoder
source, keyless index source; random weights built on the GPU, routed experts packed FP4), and each decode batch:
* a decode step under ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation raises;
* the same step captured in a CUDA graph and replayed: its logits against the eager step's (bit for bit);
* ms per step, eager and replayed, and per layer (to set beside V4's, ``benchmarks/fast_path_checks.py``).
A decode step advances each sequence's Engram history, so every timed call first restores it (inside the graph
too): each run decodes the same token at the same position from the same state.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ced_drift_v41 import slice_config, synthetic_hasher  # noqa: E402
from fast_path_checks import cuda_ms, kernel_profile, prefill_and_decode_batch  # noqa: E402

from dsinfer.engine.decode_graphs import capture_graph  # noqa: E402
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
    except Exception as exc:  # report, do not hide: the row says the capture failed and why
        row["graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    if profile:
        row["profile"] = kernel_profile(step, profile)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=384, help="routed experts per layer (V4.1-Flash: 384)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="kernel profile of each eager step, listing its TOP costliest kernels")  # fmt: skip
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    device = torch.device("cuda")
    config = slice_config(args.experts)
    model = build_native_model(config, torch.bfloat16, device)
    model.attach_engram_hasher(synthetic_hasher(config))
    result = {"device": torch.cuda.get_device_name(device), "layers": config.num_hidden_layers,
              "experts": args.experts, "weight_gib": weight_bytes(model)["all"] / 2**30, "rows": []}  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}), flush=True)
    for quantized in (False, True):
        for sequences in args.batches:
            row = check(model, sequences, args.context, quantized, device, args.repeats, args.profile)
            result["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
