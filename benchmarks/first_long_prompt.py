"""The first long prompt after start-up against the second: step by step, with the Triton kernels each step compiled.

    python benchmarks/first_long_prompt.py --flash-layers 4 --context 131072 --budget 16384
    python benchmarks/first_long_prompt.py --flash-layers 4 --arch v41 --engram-gib 4 --context 131072
    python benchmarks/first_long_prompt.py --tiny          # the harness on a CPU (the embedded default's shape)

An engine is built the way ``dsinfer bench sweep`` builds one (its model options are accepted as they are), it
serves one short request (what a start-up's own warm-up reaches), then two prompts of ``--context`` random tokens
one after the other, each prefilled in chunks of ``--budget`` tokens. Each chunk's wall time is printed beside the
same chunk of the other prompt, with the Triton kernels compiled during it (name and compile seconds, from
Triton's post-compile hook). A start-up with no compile stall shows the first prompt's chunks within a few
percent of the second's and no compile after the warm-up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsinfer.bench.sweep_model import build_bench  # noqa: E402
from dsinfer.bench.sweep_options import parse_args as parse_sweep_args  # noqa: E402
from dsinfer.bench.sweep_points import make_engine, sized_cache  # noqa: E402
from dsinfer.bench.sweep_timing import random_prompts  # noqa: E402
from dsinfer.sampling_params import SamplingParams  # noqa: E402


class CompileLog:
    """Triton kernels compiled since the last :meth:`take` (name, seconds), through the post-compile hook."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []
        self._started: dict[str, float] = {}
        self.hooked = False
        try:
            from triton import knobs
        except ImportError:  # no Triton (a CPU-only install): nothing compiles
            return
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after
        self.hooked = True

    def _before(self, *args, **kwargs) -> bool:
        self._started[str(kwargs.get("key", ""))] = time.perf_counter()
        return False  # never skips the compile

    def _after(self, *args, **kwargs) -> None:
        started = self._started.pop(str(kwargs.get("key", "")), None)
        name = getattr(kwargs.get("fn"), "name", None) or str(kwargs.get("repr", "?"))[:60]
        self.events.append((name, 0.0 if started is None else time.perf_counter() - started))

    def take(self) -> list[tuple[str, float]]:
        events, self.events = self.events, []
        return events


def prefill_steps(engine, prompt: list[int], log: CompileLog, device: torch.device) -> list[dict]:
    """Prefill one prompt to its first token; every step's wall time and compiles."""
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        steps.append({"s": time.perf_counter() - start, "tokens": engine.last_step.num_tokens,
                      "compiled": log.take()})  # fmt: skip
    return steps


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=16384, help="prefill tokens per step")
    parser.add_argument("--tiny", action="store_true", help="the embedded default at a short context (CPU)")
    parser.add_argument("--out", help="write the steps as JSON here")
    own, rest = parser.parse_known_args(argv)
    if own.tiny:
        rest = ["--context", "96", *rest]
    sweep = parse_sweep_args(["prefill", *rest])
    return own, sweep


def main(argv: list[str] | None = None) -> int:
    own, args = parse(argv)
    log = CompileLog()
    bench = build_bench(args)
    length = args.context
    blocks, _ = sized_cache(bench, 2, length + 1)
    started = time.perf_counter()
    engine = make_engine(bench, max_num_seqs=2, max_num_batched_tokens=own.budget, max_model_len=length + 1,
                         num_cache_blocks=blocks)  # fmt: skip
    built_s = time.perf_counter() - started
    vocab = bench.model.config.vocab_size
    warm = random_prompts(1, 16, vocab, args.seed + 7)[0]
    warm_steps = prefill_steps(engine, warm, log, bench.device)
    first, second = random_prompts(2, length, vocab, args.seed)
    runs = [prefill_steps(engine, first, log, bench.device), prefill_steps(engine, second, log, bench.device)]
    startup_compiles = len(log.take()) + sum(len(step["compiled"]) for step in warm_steps)
    print(f"start-up: engine built in {built_s:.1f} s (its kernel warm-up: {engine.warm_up}), then a short request "
          f"in {sum(step['s'] for step in warm_steps):.2f} s; {startup_compiles} kernels compiled")  # fmt: skip
    print(f"{'step':>4} {'tokens':>6} {'first s':>8} {'second s':>9} {'ratio':>6}  compiled during the first")
    for index, (a, b) in enumerate(zip(*runs, strict=True)):
        names = ", ".join(f"{name} {sec:.2f}s" for name, sec in a["compiled"])
        print(f"{index:>4} {a['tokens']:>6} {a['s']:>8.3f} {b['s']:>9.3f} {a['s'] / b['s']:>6.2f}  {names}")
    totals = [sum(s["s"] for s in run) for run in runs]
    worst = max(a["s"] / b["s"] for a, b in zip(*runs, strict=True))
    print(f"total: first {totals[0]:.2f} s, second {totals[1]:.2f} s; worst step ratio {worst:.2f}; "
          f"compiles during the first prompt: {sum(len(s['compiled']) for s in runs[0])}, "
          f"during the second: {sum(len(s['compiled']) for s in runs[1])}; hooked: {log.hooked}")  # fmt: skip
    if own.out:
        Path(own.out).write_text(json.dumps({"first": runs[0], "second": runs[1], "info": bench.info}, indent=1))
    bench.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
