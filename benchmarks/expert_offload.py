"""Routed experts offloaded to host memory: decode and prefill cost against all resident, and full-depth V4-Flash.

    python benchmarks/expert_offload.py --out offload.json          # one H100 80 GB or H200 141 GB, ~6 minutes
    python benchmarks/expert_offload.py --tiny                      # the same steps on the CPU, tiny shapes

(a) ``--layers`` layers of V4-Flash widths (random packed weights), same process: decode at 1 request, all
    resident, then with ``--resident-fraction`` of each layer's experts resident and the skewed router (after a
    warm-up and one re-balance, so the resident sets follow the counts); decode time per token and per layer, and
    the ratio (target <= 1.5), first with fetch-ahead on, then again with it off (each layer fetching its own
    misses), so one run says which look-ahead pays (``fetch_ahead_by_default``: what the engine would pick for
    this share resident). Prefill tokens/s of one ``--prefill-len``-token prompt in one
    chunk, both ways.
(b) Full-depth V4-Flash (43 layers, release shapes, random packed weights drawn where they live: the resident
    experts in the GPU's slots, the rest in pinned host memory; never all 147 GB in RAM), resident experts as
    ``--expert-offload auto`` sizes them (what the GPU has left after the other weights and ``--cache-gib``),
    decode at 1 and 8 streams of ``--input-len`` in / ``--output-len`` out with the uniform and the skewed router:
    TPOT, TTFT, PCIe bytes per token (prompt and generated tokens of the timed run) and the fraction of expert
    reads served from the GPU.

The skewed router is a benchmark device, not a server option: each layer's selection bias gets
``-zipf * ln(rank + 1)`` over a random ranking of its experts, so the routing follows a Zipf-like law as served
traffic does. The uniform router is the random weights' own routing.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from dsinfer.bench.shapes import flash_slice_config
from dsinfer.config import EngineConfig, ModelConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.native_random import build_native_model
from dsinfer.models.tiny import tiny_config
from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer
from dsinfer.offload.install import backbone_moes, resident_for_budget
from dsinfer.offload.random_experts import offload_random_experts
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

GIB = 2**30


def skew_router(model, zipf: float, seed: int = 0) -> None:
    """Zipf-like selection bias on every score-routed backbone layer (a benchmark device; see the docstring)."""
    generator = torch.Generator().manual_seed(seed)
    for _, moe in backbone_moes(model):
        if getattr(moe.gate, "bias", None) is None:
            continue  # hash-routed: the token picks its experts
        experts = moe.gate.bias.numel()
        rank_of_expert = torch.randperm(experts, generator=generator).float()
        moe.gate.bias.data.copy_(-zipf * torch.log1p(rank_of_expert).to(moe.gate.bias))


def build(config, args, resident: int | None, zipf: float):
    """A random model on ``args.device``; ``resident`` None: every expert resident, else offloaded in place."""
    expert_device = None if resident is None else "meta"
    model = build_native_model(config, args.dtype, args.device, seed=1, expert_device=expert_device)
    offload = None if resident is None else offload_random_experts(model, resident, seed=1)
    if zipf:
        skew_router(model, zipf)
    return model, offload


def timed_run(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict:
    """Serve ``prompts`` together; TTFT (first token of every stream) and TPOT (after it), medians over streams."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    first, done = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = now
    ttft = sorted(first[i] - start for i in ids)
    tpot = sorted((done[i] - first[i]) / max(1, output_len - 1) for i in ids)
    return {"ttft_s": ttft[len(ttft) // 2], "tpot_s": tpot[len(tpot) // 2], "elapsed_s": time.perf_counter() - start}


def traffic_delta(offload, before: dict | None, tokens: int) -> dict:
    if offload is None:
        return {"pcie_bytes_per_processed_token": 0.0, "gpu_served_fraction": 1.0, "fetched_ahead_fraction": 0.0}
    now = offload.traffic()
    before = before or dict.fromkeys(now, 0)
    reads, fetched = now["reads"] - before["reads"], now["fetched"] - before["fetched"]
    return {"pcie_bytes_per_processed_token": (now["copied_bytes"] - before["copied_bytes"]) / max(1, tokens),
            "gpu_served_fraction": (now["gpu_reads"] - before["gpu_reads"]) / max(1, reads),
            "fetched_ahead_fraction": (now["fetched_ahead"] - before["fetched_ahead"]) / max(1, fetched)}  # fmt: skip


def engine_for(model, tokenizer, args, streams: int, input_len: int) -> LLMEngine:
    config = EngineConfig(max_num_seqs=max(streams, 1), max_num_batched_tokens=max(input_len, args.chunk),
                          max_model_len=input_len + args.output_len + 8, device=args.device,
                          dtype="bfloat16" if args.dtype == torch.bfloat16 else "float32",
                          cache_memory_bytes=int(args.cache_gib * GIB))  # fmt: skip
    return LLMEngine(model, tokenizer, config)


def prompts_of(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (length,), generator=generator).tolist() for _ in range(count)]


def measure(model, offload, tokenizer, args, streams: int, input_len: int, warm: bool) -> dict:
    """Warm up (and re-balance the resident sets to the warm-up's counts), then one timed run."""
    engine = engine_for(model, tokenizer, args, streams, input_len)
    vocab = model.config.vocab_size
    if warm:
        timed_run(engine, prompts_of(streams, min(input_len, 256), vocab, 0), min(args.output_len, 16))
        if offload is not None:
            offload.rebalance()
    before = None if offload is None else offload.traffic()
    result = timed_run(engine, prompts_of(streams, input_len, vocab, 1), args.output_len)
    result.update(traffic_delta(offload, before, streams * (input_len + args.output_len)))
    engine.close()
    return result


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def per_layer_part(args, tokenizer) -> dict:
    """(a): decode at 1 request and a one-chunk prefill, all resident vs offloaded with the skewed router."""
    config = tiny_config() if args.tiny else flash_slice_config(args.layers)
    experts = config.n_routed_experts
    resident = max(1, min(experts - 1, round(args.resident_fraction * experts)))
    out = {"layers": config.num_hidden_layers, "resident_per_layer": resident, "experts": experts}
    for name, kept in (("all_resident", None), ("offloaded_skewed", resident)):
        model, offload = build(config, args, kept, args.zipf if kept else 0.0)
        if offload is not None:  # first with fetch-ahead, then without (below), whatever the default chose
            out["fetch_ahead_by_default"] = offload.layers[0].next_layer is not None
            offload.set_fetch_ahead(True)
        decode = measure(model, offload, tokenizer, args, 1, args.decode_prompt, warm=True)
        before = None if offload is None else offload.traffic()
        engine = engine_for(model, tokenizer, args, 1, args.prefill_len)
        start = time.perf_counter()
        timed_run(engine, prompts_of(1, args.prefill_len, config.vocab_size, 2), 1)
        prefill_s = time.perf_counter() - start
        engine.close()
        out[name] = {**decode, "per_layer_decode_ms": 1e3 * decode["tpot_s"] / config.num_hidden_layers,
                     "prefill_tokens_per_s": args.prefill_len / prefill_s,
                     "prefill_traffic": traffic_delta(offload, before, args.prefill_len)}  # fmt: skip
        if offload is not None:  # the same layers with every layer fetching its own misses: is look-ahead worth it
            offload.set_fetch_ahead(False)
            alone = measure(model, offload, tokenizer, args, 1, args.decode_prompt, warm=True)
            out[f"{name}_no_fetch_ahead"] = {
                **alone,
                "per_layer_decode_ms": 1e3 * alone["tpot_s"] / config.num_hidden_layers,
            }
        del model, offload, engine
        release()
    out["decode_ratio"] = out["offloaded_skewed"]["tpot_s"] / out["all_resident"]["tpot_s"]
    out["decode_ratio_no_fetch_ahead"] = (out["offloaded_skewed_no_fetch_ahead"]["tpot_s"]
                                          / out["all_resident"]["tpot_s"])  # fmt: skip
    out["prefill_ratio"] = out["offloaded_skewed"]["prefill_tokens_per_s"] / out["all_resident"]["prefill_tokens_per_s"]
    return out


def full_depth_part(args, tokenizer) -> dict:
    """(b): full-depth V4-Flash with the resident share ``auto`` gives, 1 and 8 streams, uniform and skewed."""
    config = tiny_config() if args.tiny else replace(ModelConfig(), num_nextn_predict_layers=0)
    shell = build_native_model(config, args.dtype, args.device, seed=1, expert_device="meta")
    like = backbone_moes(shell)[0][1].routed_weights()
    expert_bytes = like.nbytes // like.num_experts
    layers = len(backbone_moes(shell))
    if args.device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        budget = (free - (args.cache_gib + args.work_gib) * GIB) / GIB
        resident = min(like.num_experts - 1, resident_for_budget(budget, layers, like.num_experts, expert_bytes))
    else:
        resident = like.num_experts // 2
    del shell
    release()
    out = {"layers": layers, "resident_per_layer": resident, "experts": like.num_experts,
           "host_store_gib": layers * (like.num_experts - resident) * expert_bytes / GIB}  # fmt: skip
    model, offload = build(config, args, resident, 0.0)
    for router in ("uniform", "skewed"):
        if router == "skewed":
            skew_router(model, args.zipf)
        for streams in args.streams:
            key = f"{router}_{streams}_streams"
            out[key] = measure(model, offload, tokenizer, args, streams, args.input_len, warm=True)
            print(json.dumps({key: out[key]}), flush=True)  # each point as it lands: a long run may be cut short
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (what the CPU test runs)")
    parser.add_argument("--parts", nargs="+", choices=["per-layer", "full-depth"], default=["per-layer", "full-depth"])
    parser.add_argument("--layers", type=int, default=4, help="(a) layers of V4-Flash widths")
    parser.add_argument("--resident-fraction", type=float, default=0.8)
    parser.add_argument("--zipf", type=float, default=1.0, help="skewed router: bias -zipf * ln(rank + 1)")
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--input-len", type=int, default=8192)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--cache-gib", type=float, default=8.0)
    parser.add_argument("--work-gib", type=float, default=6.0, help="(b) GPU memory kept for activations")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.tiny:
        args.device, args.dtype = "cpu", torch.float32
        args.layers, args.prefill_len, args.chunk, args.input_len = 4, 64, 64, 48
        args.output_len, args.decode_prompt, args.cache_gib = min(args.output_len, 6), 16, 0.05
    else:
        args.device, args.dtype = "cuda", torch.bfloat16
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        vocab = (tiny_config() if args.tiny else ModelConfig()).vocab_size
        build_tiny_tokenizer(Path(tmp), vocab_size=vocab)
        tokenizer = Tokenizer.from_dir(tmp)
    if "per-layer" in args.parts:
        results["per_layer"] = per_layer_part(args, tokenizer)
        print(json.dumps({"per_layer": results["per_layer"]}, indent=1), flush=True)
    if "full-depth" in args.parts:
        results["full_depth"] = full_depth_part(args, tokenizer)
        print(json.dumps({"full_depth": results["full_depth"]}, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
