"""One sampler step, batched (counter-based noise on the logits' device) against the former row-by-row step.

    python benchmarks/sampler_step.py                                  # CPU: batch 1 32 256, V = 129,280
    python benchmarks/sampler_step.py --device cuda                    # the same on a GPU
    python benchmarks/sampler_step.py --batch 256 --modes top_p --repeats 20
    python benchmarks/sampler_step.py --threads 1                      # a shared CPU: one torch thread

Modes: ``greedy`` (temperature 0), ``top_p`` (temperature 0.8, top-p 0.95, seeded), ``penalised`` (``top_p`` plus
repetition 1.1, presence 0.3 and frequency 0.2 over a ``--prompt``-token prompt and a growing output). Each
timed step starts from float32 logits already on the device and ends with the chosen tokens on the host, and
appends one token to every request, as the engine does. The former step (``sampler_reference.sample_row_by_row``)
draws its noise on ``--noise-threads`` CPU threads from per-request generators and copies it over, as the former
sampler did. Prints the median milliseconds per step of each and the ratio former / batched.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from dsinfer.sampling.sampler import Sampler, make_sampling_state
from dsinfer.sampling.sampler_reference import sample_row_by_row
from dsinfer.sampling_params import SamplingParams

VOCAB_SIZE = 129_280
MODES = {
    "greedy": dict(temperature=0.0),
    "top_p": dict(temperature=0.8, top_p=0.95),
    "penalised": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--vocab", type=int, default=VOCAB_SIZE)
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    parser.add_argument("--prompt", type=int, default=2000, help="prompt tokens per request (penalised mode)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--noise-threads", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return parser.parse_args(argv)


def _states(mode: str, batch: int, prompt_tokens: int, vocab_size: int):
    generator = torch.Generator().manual_seed(batch)
    prompt_tokens = prompt_tokens if mode == "penalised" else 8
    states = []
    for index in range(batch):
        prompt = torch.randint(vocab_size, (prompt_tokens,), generator=generator).tolist()
        params = SamplingParams(seed=index, max_tokens=None, **MODES[mode])
        states.append(make_sampling_state(params, prompt, None))
    return states


def _time_steps(steps: dict, states: dict, logits: torch.Tensor, repeats: int, warmup: int) -> dict[str, float]:
    """Median milliseconds of each ``step(logits, states) -> token ids``, the steps taking turns (a busy machine
    slows both alike), each appending its tokens to its own states."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for index in range(warmup + repeats):
        for name, step in steps.items():
            if logits.is_cuda:
                torch.cuda.synchronize(logits.device)
            start = time.perf_counter()
            tokens = step(logits, states[name])
            elapsed = (time.perf_counter() - start) * 1e3
            for state, token in zip(states[name], tokens, strict=True):
                state.output_token_ids.append(token)
            if index >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pool = ThreadPoolExecutor(args.noise_threads) if args.noise_threads > 1 else None
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, vocab {args.vocab}")  # fmt: skip
    print(f"{'mode':>10} {'batch':>6} {'former ms':>10} {'batched ms':>11} {'ratio':>7}")
    for mode in args.modes:
        for batch in args.batch:
            logits = torch.randn(batch, args.vocab, generator=torch.Generator().manual_seed(0)).mul_(3).to(device)
            sampler = Sampler()

            def batched(logits, states, sampler=sampler):
                return [output.token_ids[0] for output in sampler(logits, states)]

            def former(logits, states):
                return sample_row_by_row(logits, states, pool)

            steps = {"former": former, "batched": batched}
            states = {name: _states(mode, batch, args.prompt, args.vocab) for name in steps}
            medians = _time_steps(steps, states, logits, args.repeats, args.warmup)
            former_ms, batched_ms = medians["former"], medians["batched"]
            print(f"{mode:>10} {batch:>6} {former_ms:>10.2f} {batched_ms:>11.2f} {former_ms / batched_ms:>7.2f}")
    if pool is not None:
        pool.shutdown()


if __name__ == "__main__":
    main()
