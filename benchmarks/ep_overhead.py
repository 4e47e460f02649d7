"""What the expert-parallel code path costs at EP = 1: decode steps of one model, single-rank vs EP, same run.

    python benchmarks/ep_overhead.py --flash-layers 4 --device cuda --dtype bfloat16 \
        --batches 1,16,64 --context 1024 --rounds 5 --steps 20 --out ep_overhead.json
    python benchmarks/ep_overhead.py                       # the embedded tiny checkpoint on the CPU: a tool check

One model, one engine per mode (each filled with the same ``--batches`` prompts of ``--context`` tokens,
prefilled untimed), and the modes' timed decode steps interleaved over ``--rounds`` rounds so drift hits
them alike. Modes:

* ``single``: the single-rank engine as ``dsinfer serve`` runs it (CUDA graphs for decode on CUDA);
* ``single-eager``: the same without CUDA graphs;
* ``ep1``: every backbone MoE layer through :class:`dsinfer.parallel.ep.ExpertParallel` over a one-rank
  process group (NCCL on CUDA, gloo on the CPU): the routing permutation, the count exchange, the three
  all-to-alls and the combine, eagerly (the all-to-all sizes are read on the host, which a graph cannot);
* ``ep1-local``: the same path with the collectives left out (what the permutation alone costs);
* ``ep1-graph``: decode CUDA graphs captured with the fixed-capacity dispatch inside
  (:mod:`dsinfer.parallel.ep_fixed`: static buffers, two NCCL all-to-alls per layer, no host read), over the
  one-rank NCCL group: what a rank engine replays;
* ``ep1-graph-local``: the same graphs with the exchange left out (at one rank it is the identity), the
  fallback should NCCL collectives not capture or replay under this torch.

Every engine runs without overlap scheduling: a step is launched and finished inside its ``step()`` call, so the
time is the step's own, and the engines sharing the model never run at once (an overlapped engine would leave its
next step running in its worker thread while the next mode's engine steps: two forwards over one model and one
process group at the same time).

The headline is ``ep1-graph / single``: the EP code path as rank engines run decode, against what one rank
serves with (the target is at most 1.03). ``ep1 / single-eager`` is the eager path's own cost. Each row also
says how many of each mode's decoded tokens equal the single-rank engine's (at EP = 1 the graphs add the same
values; random FP4 weights can still tie). A multi-rank server never runs the EP path with one rank: EP = 1
is the single-rank engine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dsinfer.bench.shapes import flash_slice_config
from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.llm import DTYPES
from dsinfer.parallel.config import free_port
from dsinfer.parallel.ep import ExpertParallel, ExpertPlacement
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

MODES = ("single", "single-eager", "ep1", "ep1-local", "ep1-graph-local", "ep1-graph")
GRAPH_MODES = ("single", "ep1-graph", "ep1-graph-local")
EP_MODES = ("ep1", "ep1-local", "ep1-graph", "ep1-graph-local")


def build(args, workdir: Path):
    from dsinfer.models.loader import load_model
    from dsinfer.models.native_random import build_native_model
    from dsinfer.models.tiny import default_model_dir
    from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer

    if args.flash_layers:
        config = flash_slice_config(args.flash_layers)
        model = build_native_model(config, DTYPES[args.dtype], args.device, seed=0)  # FP4 experts as released
        build_tiny_tokenizer(workdir, vocab_size=config.vocab_size)
        return model, Tokenizer.from_dir(workdir), f"V4-Flash widths, {args.flash_layers} layers, random FP4 experts"
    directory = default_model_dir()
    model = load_model(directory, dtype=DTYPES[args.dtype], device=args.device, progress=False)
    return model, Tokenizer.from_dir(directory), "tiny checkpoint"


def filled_engine(model, tokenizer, args, batch: int, eager: bool) -> LLMEngine:
    """An engine whose ``batch`` sequences have prefilled and decode from here on (never finishing)."""
    max_len = args.context + args.rounds * args.steps + args.warmup + 64
    config = EngineConfig(
        max_num_seqs=batch, max_num_batched_tokens=max(8192, batch), max_model_len=max_len,
        device=args.device, dtype=args.dtype, enable_prefix_caching=False, enforce_eager=eager,
        cache_memory_bytes=int(args.cache_gib * 2**30), async_scheduling=False,
        cuda_graph_sizes=None if eager or args.device.startswith("cuda") else (batch,),  # CPU: the static path
    )  # fmt: skip
    engine = LLMEngine(model, tokenizer, config)
    generator = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    vocab = model.config.vocab_size
    for _ in range(batch):
        engine.add_request(torch.randint(3, vocab - 1, (args.context,), generator=generator).tolist(), params)
    sequences = [seq for group in engine.requests.values() for seq in group]
    while not all(seq.output_token_ids for seq in sequences):
        engine.step()
    return engine


def use_dispatcher(layers, dispatcher) -> None:
    for moe in layers:
        moe.expert_parallel = dispatcher


def timed(engine: LLMEngine, steps: int, device: torch.device) -> list[float]:
    seconds = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        engine.step()  # sampling reads the tokens back: the step's GPU work is done when it returns
        seconds.append(time.perf_counter() - start)
    return seconds


def same_tokens(got: list[list[int]], reference: list[list[int]]) -> float:
    """The fraction of decoded tokens equal to the reference's, position by position."""
    pairs = [(a, b) for g, r in zip(got, reference, strict=True) for a, b in zip(g, r, strict=False)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flash-layers", type=int, default=0, help="random V4-Flash-width slice (0: tiny)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA")
    parser.add_argument("--batches", default="1,8", help="decode sequences per step, comma-separated")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode and round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cache-gib", type=float, default=2.0, help="KV cache of each mode's engine")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    device = torch.device(args.device)
    modes = args.modes.split(",")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        model, tokenizer, label = build(args, Path(tmp))
    experts = model.config.n_routed_experts
    layers = ExpertParallel(ExpertPlacement.contiguous(experts, 1), 0, None, device).attach(model)
    graph_group = dist.new_group(backend=backend) if backend == "nccl" else dist.group.WORLD  # as ranks do
    dispatchers = {
        "ep1": ExpertParallel(ExpertPlacement.contiguous(experts, 1), 0, dist.group.WORLD, device),
        "ep1-local": ExpertParallel(ExpertPlacement.contiguous(experts, 1), 0, None, device),
        "ep1-graph": ExpertParallel(ExpertPlacement.contiguous(experts, 1), 0, dist.group.WORLD, device, graph_group),
        "ep1-graph-local": ExpertParallel(ExpertPlacement.contiguous(experts, 1), 0, None, device),
    }
    for mode in ("ep1-graph", "ep1-graph-local"):
        dispatchers[mode].static_capacity = True  # the graph-safe dispatch, as rank engines capture it
    results = {"model": label, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "dtype": args.dtype, "context": args.context, "rows": []}  # fmt: skip
    for batch in (int(b) for b in args.batches.split(",")):
        engines, graphed = {}, {}
        for mode in modes:  # each engine captures its graphs (if any) with its mode's dispatcher attached
            use_dispatcher(layers, dispatchers.get(mode))
            engines[mode] = filled_engine(model, tokenizer, args, batch, eager=mode not in GRAPH_MODES)
            graphed[mode] = engines[mode].runner.decode_graphs is not None
            if device.type == "cuda" and graphed[mode] != (mode in GRAPH_MODES):
                raise SystemExit(f"mode {mode}: decode graphs are {'on' if graphed[mode] else 'off'}")
        samples: dict[str, list[float]] = {mode: [] for mode in modes}
        for round_index in range(args.rounds):
            for mode in modes if round_index % 2 == 0 else reversed(modes):
                use_dispatcher(layers, dispatchers.get(mode))
                if round_index == 0:
                    timed(engines[mode], args.warmup, device)
                samples[mode] += timed(engines[mode], args.steps, device)
        use_dispatcher(layers, None)
        tokens = {mode: [seq.output_token_ids for g in e.requests.values() for seq in g] for mode, e in engines.items()}
        for engine in engines.values():
            engine.close()
        del engines
        median = {mode: 1e3 * statistics.median(s) for mode, s in samples.items()}
        row = {"batch": batch, "median_ms_per_step": median, "decode_graphs": graphed}  # V4.1 (the tiny one): none
        if "single" in tokens:
            row["tokens_equal_to_single"] = {mode: same_tokens(t, tokens["single"]) for mode, t in tokens.items()}
        for mode in EP_MODES:
            if mode in median:
                for base in ("single", "single-eager"):
                    if base in median:
                        row[f"{mode}/{base}"] = median[mode] / median[base]
        results["rows"].append(row)
        print(json.dumps(row))
    dist.destroy_process_group()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
