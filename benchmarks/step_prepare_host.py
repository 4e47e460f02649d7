"""The host's share of a decode step at long context: ``ModelRunner.prepare`` for many sequences, and the cyclic
garbage collections the step's allocations set off.

    python benchmarks/step_prepare_host.py                              # 256 sequences x 131,072 tokens
    python benchmarks/step_prepare_host.py --sequences 64 --context 16384
    PYTHONPATH=../older-checkout python benchmarks/step_prepare_host.py # the same against other code

Each of ``--steps`` decode steps appends a token to every sequence, prepares the step (the sequences' rows, spans
and block tables, as the engine hands them to the device worker), keeps the last two steps' inputs alive (a step
runs while the next is planned), and allocates ``--step-objects`` small containers (what the rest of a step makes:
outputs, reports). Before the steps the heap is frozen, as ``dsinfer serve`` freezes it after start-up, so the
collections counted are the steps' own. The runner has no model: ``prepare`` reads only the sequences, so its
time is the host's, on any machine. Prints the median ``prepare`` time and the collections' count, total and
longest time (Python's ``gc.callbacks``).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import torch

from dsinfer.engine.model_runner import ModelRunner
from dsinfer.engine.scheduler import ScheduledSequence
from dsinfer.engine.sequence import Sequence
from dsinfer.sampling.sampler import make_sampling_state
from dsinfer.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-objects", type=int, default=3000)
    args = parser.parse_args()
    prompt = [random.randrange(129280) for _ in range(args.context)]
    blocks = -(-args.context // args.block_tokens) + 1
    sequences = []
    for index in range(args.sequences):
        seq = Sequence(f"r{index}", 0, prompt, make_sampling_state(SamplingParams(), prompt, None))
        seq.slot, seq.num_computed = index, args.context
        seq.block_table = list(range(index * blocks, (index + 1) * blocks))
        sequences.append(seq)
    runner = ModelRunner.__new__(ModelRunner)  # what prepare reads; no model, no cache
    runner.device, runner.speculative, runner.replay_tokens, runner._engram_width = torch.device("cpu"), False, 0, 0
    collections: list[float] = []

    def timed_collection(phase: str, info: dict) -> None:
        if phase == "start":
            timed_collection.started = time.perf_counter()
        else:
            collections.append((time.perf_counter() - timed_collection.started) * 1e3)

    gc.collect()
    gc.freeze()
    gc.callbacks.append(timed_collection)
    prepare_ms, in_flight = [], []
    for _ in range(args.steps):
        for seq in sequences:
            seq.output_token_ids.append(7)
        scheduled = [ScheduledSequence(seq, 1) for seq in sequences]
        start = time.perf_counter()
        in_flight = [*in_flight[-1:], runner.prepare(scheduled)]
        prepare_ms.append((time.perf_counter() - start) * 1e3)
        for seq in sequences:
            seq.num_computed += 1
        step_objects = [{} for _ in range(args.step_objects)]
        del step_objects
    gc.callbacks.remove(timed_collection)
    total = sum(collections)
    print(f"{args.sequences} sequences x {args.context:,} tokens, {args.steps} steps: prepare median "
          f"{statistics.median(prepare_ms):.3f} ms; {len(collections)} collections, {total:.1f} ms in all "
          f"({total / args.steps:.3f} ms a step), longest {max(collections, default=0.0):.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
