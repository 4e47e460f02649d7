"""How far DeepSeek-V4.1's bounded CED prefill drifts from the exact one, and what it saves.

    python benchmarks/ced_drift_v41.py --preset tiny --tokens 256 1024 --replay 140 28
    python benchmarks/ced_drift_v41.py --preset slice --tokens 1024 4096 --dtype bfloat16   # on a GPU

For each prompt the script prefills twice from an empty cache, ``exact`` (every layer over the whole
prompt) and ``bounded`` (encoder over the prompt, decoder over the last ``replay`` tokens), then feeds
both caches the same ``--decode`` continuation tokens (greedy from the exact run). It reports, for the
last prompt token and over the decode steps: the largest logit deviation relative to the largest exact
logit, the KL divergence of the bounded distribution from the exact one, and top-1 agreement; the
prefill times; and, as the noise floor, the same deviation between the exact prefill run in one piece
and in two chunks (which differ only by floating-point evaluation order and the rounding decisions
that order flips).

Presets (random weights, fake quantization on, Engram on with a synthetic compressed vocabulary):

* ``tiny``: the tiny V4.1 architecture of ``make-tiny --arch v41`` (window 16 unless ``--window``);
* ``slice``: every V4.1-Flash width (hidden 5120, 64 heads x 512, q rank 1280, indexer 32 x 128 top 512,
  2048 candidate blocks of 8, window 128, Engram heads 8 x 256) over 4 layers (window + Engram, a ratio-2
  source, the ratio-1 decoder source, a keyless index source) with ``--experts`` of the 384 routed experts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace

import torch

from dsinfer.bench.v41_slice import synthetic_hasher, v41_slice_config
from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.models.tiny import build_random_model, tiny_config_v41

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kl(exact: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    log_p, log_q = exact.log_softmax(-1), other.log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


@torch.inference_mode()
def measure(model, tokens: list[int], replay: int, decode: int, device: torch.device) -> dict:
    cfg = model.config
    length = len(tokens)
    total = length + decode
    blocks = -(-total // 64)
    results, caches, times = {}, {}, {}
    table = list(range(blocks))
    for mode in ("exact", "bounded"):
        cache = KVCacheV41(cfg, 1, blocks, 64, model.embed.weight.dtype, device)
        span = SequenceSpan(0, length, 0, table)
        batch = PackedBatch(torch.tensor(tokens, device=device), torch.arange(length, device=device), [span], cache)
        synchronize(device)
        start = time.perf_counter()
        results[mode] = [model.prefill(batch, mode, replay)[0].float()]
        synchronize(device)
        times[mode] = time.perf_counter() - start
        caches[mode] = cache
    # The noise floor: the exact prefill again in two chunks differs only by rounding (evaluation order).
    caches["chunked"] = KVCacheV41(cfg, 1, blocks, 64, model.embed.weight.dtype, device)
    half = length // 2
    for first, count in ((0, half), (half, length - half)):
        span = SequenceSpan(first, count, 0, table)
        ids = torch.tensor(tokens[first : first + count], device=device)
        batch = PackedBatch(ids, torch.arange(first, first + count, device=device), [span], caches["chunked"])
        logits = model(batch, logits_for=batch.last_token_indices())
    results["chunked"] = [logits[0].float()]
    continuation = []
    for step in range(decode):
        token = int(results["exact"][-1].argmax())
        continuation.append(token)
        position = length + step
        for mode in ("exact", "bounded", "chunked"):
            span = SequenceSpan(position, 1, 0, table, window_from=length - replay if mode == "bounded" else 0)
            batch = PackedBatch(
                torch.tensor([token], device=device), torch.tensor([position], device=device), [span], caches[mode]
            )
            results[mode].append(model(batch)[0].float())
    exact, bounded = torch.stack(results["exact"]), torch.stack(results["bounded"])
    relative = (bounded - exact).abs().amax(-1) / exact.abs().amax(-1)
    noise = (torch.stack(results["chunked"]) - exact).abs().amax(-1) / exact.abs().amax(-1)
    divergence = kl(exact, bounded)
    agree = (exact.argmax(-1) == bounded.argmax(-1)).float()
    return {
        "tokens": length,
        "replay": replay,
        "last_rel_max_err": float(relative[0]),
        "last_kl": float(divergence[0]),
        "last_top1_agree": bool(agree[0]),
        "noise_rel_max_err": float(noise.max()),
        "decode_rel_max_err_max": float(relative[1:].max()) if decode else None,
        "decode_kl_mean": float(divergence[1:].mean()) if decode else None,
        "decode_top1_agree": float(agree[1:].mean()) if decode else None,
        "exact_prefill_s": times["exact"],
        "bounded_prefill_s": times["bounded"],
    }


@torch.inference_mode()
def dspark_check(model, tokens: list[int], device: torch.device) -> dict:
    """Seed the DSpark rings from one prompt's target hiddens and draft one block (runs the draft stages)."""
    batch = PackedBatch.from_sequences([tokens], device=device)
    _, _, ctx = model.run_layers(batch, capture=True)
    model.dspark_seed(batch, ctx)
    synchronize(device)
    start = time.perf_counter()
    draft = model.dspark_draft(batch.cache, 0, len(tokens) - 1, tokens[-1])
    synchronize(device)
    return {
        "dspark_draft_s": time.perf_counter() - start,
        "dspark_tokens": draft.tokens,
        "dspark_confidence": [round(float(c), 4) for c in draft.confidence],
        "finite": bool(torch.isfinite(draft.logits).all()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=["tiny", "slice"], default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--replay", type=int, nargs="+", default=[140])
    parser.add_argument("--prompts", type=int, default=3, help="random prompts per length")
    parser.add_argument("--decode", type=int, default=16, help="teacher-forced decode steps after the prefill")
    parser.add_argument("--window", type=int, default=None, help="tiny preset: override the sliding window")
    parser.add_argument("--experts", type=int, default=64, help="slice preset: routed experts (of 384)")
    parser.add_argument("--no-fake-quant", action="store_true", help="turn the trained-in rounding off (isolates it)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if args.preset == "tiny":
        config = tiny_config_v41(engram_compressed_vocab_size=400)
        if args.window:
            config = replace(config, sliding_window=args.window)
    else:
        config = v41_slice_config(4, args.experts)
    start = time.perf_counter()
    model = build_random_model(config, DTYPES[args.dtype], device, seed=args.seed)
    model.attach_engram_hasher(synthetic_hasher(config))
    model.set_fake_quantization(not args.no_fake_quant)
    synchronize(device)
    header = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "window": config.sliding_window,
        "fake_quant": model.fake_quantization,
        "build_s": time.perf_counter() - start,
    }
    if device.type == "cuda":
        header["gpu_memory_gib"] = torch.cuda.memory_allocated(device) / 2**30
    print(json.dumps(header), flush=True)
    rows = []
    generator = torch.Generator().manual_seed(args.seed)
    for length in args.tokens:
        prompts = [
            torch.randint(3, config.vocab_size - 1, (length,), generator=generator).tolist()
            for _ in range(args.prompts)
        ]
        for replay in args.replay:
            runs = [measure(model, prompt, replay, args.decode, device) for prompt in prompts]
            row = {key: runs[0][key] for key in ("tokens", "replay")}
            for key in ("last_rel_max_err", "last_kl", "decode_rel_max_err_max", "decode_kl_mean", "noise_rel_max_err"):
                values = [run[key] for run in runs if run[key] is not None]
                row[key + "_median"] = statistics.median(values) if values else None
                row[key + "_max"] = max(values) if values else None
            row["last_top1_agree"] = sum(run["last_top1_agree"] for run in runs) / len(runs)
            row["decode_top1_agree"] = statistics.mean(run["decode_top1_agree"] or 0.0 for run in runs)
            row["exact_prefill_s_median"] = statistics.median(run["exact_prefill_s"] for run in runs)
            row["bounded_prefill_s_median"] = statistics.median(run["bounded_prefill_s"] for run in runs)
            rows.append(row)
            print(json.dumps(row), flush=True)
    header["dspark"] = dspark_check(model, prompts[0], device)
    print(json.dumps(header["dspark"]), flush=True)
    if device.type == "cuda":
        header["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump({**header, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
