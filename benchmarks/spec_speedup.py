"""End-to-end speed-up of speculative decoding: a checkpoint's held-out chats through the engine, plain vs drafted.

    python benchmarks/spec_speedup.py --device cuda --streams 1 16 --modes plain dspark:3 --rounds 3
    python benchmarks/spec_speedup.py --device cuda --streams 1 16 --modes plain dspark:3 dspark:3:eager

The chats are the trained default's held-out evaluation prompts (every skill, both thinking modes), replied to
greedily. ``--streams N`` keeps N requests in flight (a closed loop: a finished request's place goes to the next
prompt) on an engine of ``max_num_seqs`` N. Each mode (``plain``, or ``METHOD:K`` such as ``dspark:3``; a trailing
``:eager`` turns CUDA graphs off for that engine, so graphed and eager verify steps compare in one run) has its
own engine, built once (CUDA graphs captured, kernels compiled by ``--warmup-rounds`` untimed rounds of the whole
workload); the rounds interleave the modes so that drift of the machine hits them alike. Reported per mode and
stream count: median output tokens/s, the speed-up over ``plain`` (same run), τ (tokens per verify round, the
engine's counters), how many replies equal plain decoding's (greedy: all of them in float32), and for drafting
modes the share of verify steps that replayed the graphs (``graphed_steps``) and of those with prefill chunks
beside them whose decodes replayed the graphs and whose chunks ran eagerly (``split_steps``); the rest ran
eagerly. Where a step's time goes: ``ms_per_step`` (wall time over engine steps, prefill steps included),
``step_kinds`` (the last round's median wall ms, count and seconds of the steps that admitted a request, so
prefilled its prompt, and of the others) and, for graphed drafting modes, ``replay_ms`` (median device time of the
verify and the draft replay, :mod:`dsinfer.speculative.phase_clock`); a round's wall time beyond the two replays
is the host's. ``--profile-chats N`` then serves N chats of each mode under ``torch.profiler`` (a session a step)
and adds the kernels and device time a step and the 25 costliest kernels to each row (``profile``), for the
admitting and the decoding steps apart too (``profile.by_kind``).

Every mode gets the same prompts, ``max_tokens`` and greedy sampling, and V4.1 prompts prefill ``exact`` in every
mode (``--v41-prefill``): left to the engine, plain decoding of a checkpoint with a CED decoder prefills
``bounded`` while drafting engines prefill ``exact``, and the replies would then differ for prompts longer than
the replay without any fault in speculation. Each row names the replies that differ from the first mode's
(``differing``) and, past the first stream count, how many equal the same mode's replies at the first stream
count (batching alone should change no greedy reply). ``--no-rounding`` turns the model's activation rounding
off: with it on, a last-bit difference between two kernels' sums (batch shapes choose kernels) can cross an FP8
rounding boundary and change a reply; with it off, a differing reply is a fault, not rounding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsinfer.bench.step_profile import laid_end_to_end, profiled_spans, timeline_summary
from dsinfer.bench.sweep_timing import drain_device, recapture_graphs
from dsinfer.chat.format import ChatFormat
from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import default_model_dir
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer
from dsinfer.training import corpus
from dsinfer.training.render import SampleRenderer


def held_out_prompts(tokenizer: Tokenizer, chats: int) -> list[list[int]]:
    renderer = SampleRenderer(ChatFormat(tokenizer, "v41", "default"))
    return [renderer.prompt_ids(sample) for skill in corpus.SKILLS for thinking in (True, False)
            for sample in corpus.held_out(skill, chats, thinking=thinking)]  # fmt: skip


def speculative_config(mode: str) -> dict | None:
    if mode.removesuffix(":eager") == "plain":
        return None
    method, _, k = mode.removesuffix(":eager").partition(":")
    return {"method": method, "num_speculative_tokens": int(k)}


def graphed_steps(engine: LLMEngine) -> tuple[int, int, int]:
    """(verify steps the graphs served, steps split between them and the eager path, steps through the speculative
    executor) since the engine started."""
    executor = engine.worker.speculative
    return (0, 0, 0) if executor is None else (executor.graphed_steps, executor.split_steps, executor.steps)


def serve(engine: LLMEngine, prompts: list[list[int]], streams: int, max_tokens: int) -> tuple[float, list]:
    """Closed loop over ``prompts`` with ``streams`` in flight; wall seconds and the replies in prompt order."""
    seconds, replies, _ = serve_counted(engine, prompts, streams, max_tokens)
    return seconds, replies


def step_kind_ms(steps: dict[str, list[float]]) -> dict:
    """Median wall ms, count and total seconds of a round's admitting and decoding steps (:func:`serve_counted`)."""
    return {kind: {"median_ms": round(1e3 * statistics.median(times), 3) if times else None, "steps": len(times),
                   "seconds": round(sum(times), 3)} for kind, times in steps.items()}  # fmt: skip


def serve_counted(engine: LLMEngine, prompts: list[list[int]], streams: int, max_tokens: int,
                  run_step=None) -> tuple:  # fmt: skip
    """:func:`serve`, and its engine steps' wall seconds: ``{"admit": [...], "decode": [...]}`` (``admit``: the
    steps right after a request joined, which prefill its prompt; ``decode``: the others). ``run_step(kind)``, when
    given, runs each step (``engine.step()``) and returns its outputs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    queue, replies, owner, steps = list(enumerate(prompts)), {}, {}, {"admit": [], "decode": []}
    start = time.perf_counter()
    while queue or engine.has_unfinished_requests():
        kind = "decode"
        while queue and len(owner) < streams:
            index, prompt = queue.pop(0)
            owner[engine.add_request(prompt, params)] = index
            kind = "admit"
        step_start = time.perf_counter()
        for out in engine.step() if run_step is None else run_step(kind):
            if out.finished:
                replies[owner.pop(out.request_id)] = out.outputs[0].token_ids
        steps[kind].append(time.perf_counter() - step_start)
    return time.perf_counter() - start, [replies[i] for i in range(len(prompts))], steps


def start_phase_clocks(engines: dict[str, LLMEngine]) -> dict:
    """A phase clock on every engine whose verify steps replay graphs (:mod:`dsinfer.speculative.phase_clock`)."""
    clocks = {}
    for mode, engine in engines.items():
        executor = engine.worker.speculative
        if executor is not None and executor.graphs is not None:
            clocks[mode] = executor.graphs.start_phase_clock()
    return clocks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--modes", nargs="+", default=["plain", "dspark:3"])
    parser.add_argument("--chats", type=int, default=2, help="held-out chats per skill and thinking mode")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--warmup-rounds", type=int, default=1, help="untimed rounds of the whole workload (shapes compile kernels)"
    )
    parser.add_argument("--cache-gib", type=float, default=2.0)
    parser.add_argument("--v41-prefill", default="exact", help="V4.1 prefill of every mode (exact / bounded)")
    parser.add_argument("--no-rounding", action="store_true", help="turn the model's activation rounding off")
    parser.add_argument(
        "--profile-chats", type=int, default=0, help="after the timed rounds, profile this many chats of each mode"
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.profile_chats < 0:
        parser.error(f"--profile-chats: must not be negative, got {args.profile_chats}")
    return args


def profile_mode(engine: LLMEngine, prompts: list[list[int]], streams: int, max_tokens: int) -> dict:
    """``torch.profiler`` over serving ``prompts``, one session a step (each ends once the step's device work has):
    :func:`~dsinfer.bench.step_profile.timeline_summary` per engine step (kernels and device time a step, the top
    25 kernels), the same for the admitting and the decoding steps apart (``by_kind``), and the steps' kinds. The
    sessions are laid end to end (:func:`~dsinfer.bench.step_profile.laid_end_to_end`): a kind's span and idle
    time are its own steps', not the time between them. The first session records the engine's CUDA graphs again
    before its step (:func:`~dsinfer.bench.sweep_timing.recapture_graphs`): graphs instantiated before any
    profiler session replay unseen in every later one."""
    device = torch.device(engine.config.device)
    sessions: dict[str, list] = {"admit": [], "decode": []}  # each step's spans, a session a step

    def run_step(kind: str) -> list:
        outputs: list = []
        first = not any(sessions.values())
        sessions[kind].append(profiled_spans(lambda: outputs.extend(engine.step()), device,
                                             prepare=(lambda: recapture_graphs(engine)) if first else None,
                                             drain=lambda: drain_device(engine)))  # fmt: skip
        return outputs

    steps = serve_counted(engine, prompts, streams, max_tokens, run_step)[2]
    every = laid_end_to_end(sessions["admit"] + sessions["decode"])
    summary = timeline_summary(every, max(1, sum(len(times) for times in steps.values())), top=25, gaps_listed=0)
    by_kind = {kind: timeline_summary(laid_end_to_end(sessions[kind]), len(steps[kind]), top=25, gaps_listed=0)
               for kind in sessions if steps[kind]}  # fmt: skip
    return {"step_kinds": step_kind_ms(steps), "by_kind": by_kind, **summary}


@dataclass
class StreamRun:
    """Every mode's timed rounds at one stream count: ``(seconds, tokens, steps)`` a round, the last round's
    replies and step kinds, tau, graphed-step counts, replay times and profiles."""

    streams: int
    times: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)
    replies: dict[str, list] = field(default_factory=dict)
    kinds: dict[str, dict] = field(default_factory=dict)
    tau: dict[str, float] = field(default_factory=dict)
    graphed: dict[str, list[int]] = field(default_factory=dict)
    replay_ms: dict[str, dict] = field(default_factory=dict)  # the phase clocks' medians over the timed rounds
    profiles: dict[str, dict] = field(default_factory=dict)


def build_engines(args: argparse.Namespace, model, tokenizer: Tokenizer, prompts: list, streams: int) -> dict:
    """One engine a mode, warmed over the whole workload: each new batch shape (prompt lengths, decode buckets,
    verify widths) can compile kernels, and one short request does not meet them all (a first round took far
    longer than the second)."""
    engines = {}
    for mode in args.modes:
        config = EngineConfig(max_num_seqs=streams, max_model_len=2048, max_num_batched_tokens=2048,
                              device=args.device, dtype=args.dtype, cache_memory_bytes=int(args.cache_gib * 2**30),
                              speculative_config=speculative_config(mode), v41_prefill=args.v41_prefill,
                              enforce_eager=mode.endswith(":eager"))  # fmt: skip
        engines[mode] = LLMEngine(model, tokenizer, config)
        for _ in range(args.warmup_rounds):
            serve(engines[mode], prompts, streams, args.max_tokens)
    return engines


def run_streams(args: argparse.Namespace, model, tokenizer: Tokenizer, prompts: list, streams: int) -> StreamRun:
    """The timed rounds of every mode at ``streams`` (interleaved, so drift hits the modes alike)."""
    engines = build_engines(args, model, tokenizer, prompts, streams)
    run = StreamRun(streams, times={mode: [] for mode in args.modes})
    before = {mode: graphed_steps(engine) for mode, engine in engines.items()}  # counted from here
    clocks = start_phase_clocks(engines)
    for _ in range(args.rounds):
        for mode, engine in engines.items():
            stats = engine.spec_stats
            drafts_before = (stats.num_drafts, stats.num_accepted_tokens) if stats is not None else None
            seconds, run.replies[mode], steps = serve_counted(engine, prompts, streams, args.max_tokens)
            count = sum(len(times) for times in steps.values())
            run.times[mode].append((seconds, sum(len(r) for r in run.replies[mode]), count))
            run.kinds[mode] = step_kind_ms(steps)
            if drafts_before is not None:
                rounds = stats.num_drafts - drafts_before[0]
                accepted = stats.num_accepted_tokens - drafts_before[1]
                run.tau[mode] = 1 + accepted / rounds if rounds else 1.0
    run.replay_ms = {mode: clock.medians() for mode, clock in clocks.items()}  # before any profiled step
    for mode, engine in engines.items():
        run.graphed[mode] = [now - then for now, then in zip(graphed_steps(engine), before[mode], strict=True)]
        if args.profile_chats:
            run.profiles[mode] = profile_mode(engine, prompts[: args.profile_chats], streams, args.max_tokens)
        engine.close()
    return run


def result_row(args: argparse.Namespace, run: StreamRun, mode: str, first: list) -> dict:
    """One mode's row: its rate against the first mode's, its replies against the first mode's and against its
    own at the first stream count (``first``), and where its steps went."""
    rate_of = {m: statistics.median(tokens / seconds for seconds, tokens, _ in run.times[m]) for m in args.modes}
    rate, replies, count = rate_of[mode], run.replies[mode], len(run.replies[mode])
    differing = [i for i, (a, b) in enumerate(zip(replies, run.replies[args.modes[0]], strict=True)) if a != b]
    across = sum(a == b for a, b in zip(replies, first, strict=True))
    graphed, times = run.graphed[mode], run.times[mode]
    row = {"streams": run.streams, "mode": mode, "output_tok_s": round(rate, 1),
           "speedup": round(rate / rate_of[args.modes[0]], 3),
           "tau": round(run.tau[mode], 3) if mode in run.tau else None,
           "replies_equal_to_first_mode": f"{count - len(differing)}/{count}", "differing": differing,
           f"replies_equal_at_{args.streams[0]}_streams": f"{across}/{count}",
           "graphed_steps": f"{graphed[0]}/{graphed[2]}" if graphed[2] else None,
           "split_steps": graphed[1] if graphed[2] else None,
           "ms_per_step": round(statistics.median(1e3 * s / n for s, _, n in times), 3),
           "replay_ms": run.replay_ms.get(mode), "step_kinds": run.kinds[mode],
           "seconds": [round(s, 2) for s, _, _ in times]}  # fmt: skip
    if mode in run.profiles:
        row["profile"] = run.profiles[mode]
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    directory = args.model or str(default_model_dir())
    model = load_model(directory, dtype=getattr(torch, args.dtype), device=args.device, progress=False)
    if args.no_rounding:
        if not hasattr(model, "set_fake_quantization"):
            raise SystemExit("--no-rounding: this checkpoint's model has no activation rounding to turn off")
        model.set_fake_quantization(False)
    tokenizer = Tokenizer.from_dir(directory)
    prompts = held_out_prompts(tokenizer, args.chats)
    result = {"model": directory, "device": args.device, "dtype": args.dtype, "prompts": len(prompts),
              "v41_prefill": args.v41_prefill, "rounding": not args.no_rounding, "rows": []}  # fmt: skip
    first_replies: dict[str, list] = {}  # each mode's replies at the first stream count
    if args.device.startswith("cuda"):
        result["gpu"] = torch.cuda.get_device_name(args.device)
    for streams in args.streams:
        run = run_streams(args, model, tokenizer, prompts, streams)
        for mode in args.modes:
            row = result_row(args, run, mode, first_replies.setdefault(mode, run.replies[mode]))
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
