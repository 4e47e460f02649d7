"""Time (and optionally profile) training steps of the default model, as the trainer runs them.

    python benchmarks/train_step.py --batch-tokens 16384 --steps 3 --profile     # one H200
    python benchmarks/train_step.py --batch-tokens 600 --steps 1 --workers 0     # a CPU check of the tool

Builds the default preset's model (tokenizer from ``--tokenizer-chats`` rendered chats), runs two untimed steps,
times ``--steps`` more, then with ``--profile`` records one step with torch.profiler and prints the GPU kernel
time, the number of kernel launches and the ops by self time: whether a step is bound by its arithmetic or by
its launches.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from dsinfer.training import trainer
from dsinfer.training.chat_stream import ChatStream


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch-tokens", type=int, default=16384)
    parser.add_argument("--sequence-tokens", type=int, default=None, help="packed sequence length (preset's if unset)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--workers", type=int, default=4, help="chat-rendering processes")
    parser.add_argument("--tokenizer-chats", type=int, default=2000)
    parser.add_argument("--profile", action="store_true", help="profile one more step")
    args = parser.parse_args()
    device = args.device
    settings = replace(trainer.PRESETS["default"], batch_tokens=args.batch_tokens, data_workers=args.workers,
                       tokenizer_chats=args.tokenizer_chats)  # fmt: skip
    if args.sequence_tokens is not None:
        settings = replace(settings, sequence_tokens=args.sequence_tokens)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = trainer.build_tokenizer(Path(scratch), settings)
        model = trainer.trainable_model(tokenizer, settings, device)
        optimizer = trainer._optimizer(model, settings)
        chats = ChatStream(Path(scratch), settings.seed, settings.data_workers)
        data = trainer.batches(chats, settings)
        rng = random.Random(0)

        def step() -> float:
            batch = next(data)
            start = time.perf_counter()
            trainer._step(model, optimizer, batch, settings, rng, device)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            return time.perf_counter() - start

        for _ in range(2):
            step()
        times = [step() for _ in range(args.steps)]
        print(f"{args.batch_tokens} tokens per step on {device}: " + ", ".join(f"{t:.3f} s" for t in times))
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
            with profile(activities=activities) as recorded:
                step()
            events = recorded.key_averages()
            launches = sum(
                e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
            )
            print(f"GPU kernel time {sum(e.self_device_time_total for e in events) / 1e3:.1f} ms, {launches} launches")
            print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
        chats.close()


if __name__ == "__main__":
    main()
