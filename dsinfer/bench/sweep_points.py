"""One sweep point: a fresh engine sized for it, filled (decode) or fed (prefill), its steps timed.

Each engine's cache holds exactly the point's sequences (``num_cache_blocks``), after the per-kind accounting of
:mod:`dsinfer.bench.cache_budget` has checked that they fit the budget: a point that cannot fit is refused with
one message before anything is allocated, and the memory the cache does not need stays free for the step's
work (a 32,768-token prefill's activations at Flash widths take gigabytes).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from datetime import UTC, datetime
from typing import Any

import torch

from dsinfer.bench.cache_budget import cache_budget, refusal
from dsinfer.bench.coin_acceptance import accept_by_coin
from dsinfer.bench.published import record_estimate
from dsinfer.bench.step_profile import profile_steps
from dsinfer.bench.sweep_model import Bench, cache_kinds, decode_max_model_len, gpu_name
from dsinfer.bench.sweep_options import CPU_FILL_BUDGET, DTYPES, FILL_CANDIDATES, dp_rank, world_size
from dsinfer.bench.sweep_timing import (
    checked_step,
    drain_device,
    head_ms,
    prefill_measure_steps,
    random_prompts,
    recapture_graphs,
    run_steps,
    speculative_accounting,
    step_statistics,
    timed_steps,
)
from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.kv.sequence_bytes import sequence_bytes
from dsinfer.sampling_params import SamplingParams


class PointSkipped(Exception):
    """A point that cannot run here (cache too small, out of memory); the sweep records it and goes on."""


# ---- engines ---------------------------------------------------------------------------------
def make_engine(bench: Bench, **options) -> LLMEngine:
    """A fresh engine for one point; prefix caching off so every prompt token is computed.

    The previous engine's cache must be back with the device first: on CUDA the engine sizes its cache from
    the free memory, and memory the caching allocator still holds does not count as free.
    """
    args = bench.args
    release_memory(bench.device)
    cache_bytes = None if args.cache_gib is None else int(args.cache_gib * 2**30)
    options = {"enable_prefix_caching": False, "cache_memory_bytes": cache_bytes,
               "enforce_eager": args.enforce_eager, "kv_cache_dtype": args.kv_cache_dtype, **options}  # fmt: skip
    if bench.is_v41:
        options.setdefault("v41_prefill", bench.info["v41_prefill"])
    config = EngineConfig(device=args.device, dtype=args.dtype, **options)
    try:
        return LLMEngine(bench.model, bench.tokenizer, config)
    except ValueError as exc:  # the cache budget cannot hold one sequence
        raise PointSkipped(str(exc)) from None


def release_memory(device: torch.device) -> None:
    """Drop what finished engines left behind, so the next one sees the whole device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sized_cache(bench: Bench, sequences: int, tokens_each: int) -> tuple[int, dict[str, Any]]:
    """Blocks for ``sequences`` of ``tokens_each`` (one spare each), after checking they fit the budget; and
    what the record says about it. Raises :class:`PointSkipped` with the accounting's message when they do not."""
    release_memory(bench.device)
    _, storage, engine_kinds = cache_kinds(bench, tokens_each)
    per_sequence = sequence_bytes(engine_kinds)
    budget = cache_budget(bench.args.cache_gib, bench.device)
    message = refusal(sequences, tokens_each, per_sequence, budget)
    if message is not None:
        raise PointSkipped(message)
    blocks = sequences * (math.ceil(tokens_each / bench.model.cache_block_tokens(None)) + 1)
    info = {"storage": storage, "bytes_per_sequence": per_sequence, "budget_bytes": budget[0],
            "budget_from": budget[1], "sequences_that_fit": budget[0] // max(per_sequence, 1)}  # fmt: skip
    return blocks, info


def check_cache_holds(engine: LLMEngine, sequences: int, tokens_each: int) -> None:
    """Skip the point rather than let preemption thrash: all sequences must fit the cache at once."""
    per_sequence = math.ceil(tokens_each / engine.runner.block_tokens)
    if sequences * per_sequence > engine.runner.num_blocks:
        raise PointSkipped(
            f"the cache holds {engine.runner.num_blocks} blocks of {engine.runner.block_tokens} tokens; "
            f"{sequences} sequences of {tokens_each} tokens need {sequences * per_sequence} (raise --cache-gib)"
        )


# ---- the decode fill's budget ----------------------------------------------------------------
def fastest_fill_budget(candidates: Iterable[int], probe: Callable[[int], float]) -> tuple[int, dict[int, Any]]:
    """The candidate whose probe prefills the most tokens per second, and every probe's result (tokens/s, or why
    it could not run: a candidate that runs out of memory is no candidate)."""
    results: dict[int, Any] = {}
    for budget in candidates:
        try:
            results[budget] = probe(budget)
        except (PointSkipped, torch.OutOfMemoryError) as exc:
            results[budget] = f"not run: {str(exc).splitlines()[0]}"
    timed = {budget: rate for budget, rate in results.items() if not isinstance(rate, str)}
    if not timed:
        raise PointSkipped(f"no fill budget could run: {results}")
    return max(timed, key=timed.get), results


def probed_fill_candidates(context: int) -> list[int]:
    """The fill budgets worth probing at ``context``: those a prompt fills in two steps or more (the probe times
    the second step of one prompt; a shorter prompt would have finished)."""
    return [budget for budget in FILL_CANDIDATES if 2 * budget <= context]


def probe_fill(bench: Bench, budget: int) -> float:
    """Tokens per second of one ``budget``-token prefill step of a long prompt (after one untimed step at that
    shape, which compiles what the shape needs)."""
    length = 2 * budget
    blocks, _ = sized_cache(bench, 1, length + 1)
    engine = make_engine(bench, max_num_seqs=1, max_num_batched_tokens=budget, max_model_len=length + 1,
                         num_cache_blocks=blocks)  # fmt: skip
    engine.add_request(random_prompts(1, length, bench.model.config.vocab_size, bench.args.seed)[0],
                       SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))  # fmt: skip
    try:
        checked_step(engine)
        start = time.perf_counter()
        checked_step(engine)
        return engine.last_step.num_tokens / (time.perf_counter() - start)
    finally:
        del engine
        release_memory(bench.device)


def fill_budget(bench: Bench) -> int:
    """``--prefill-chunk``, else (auto) on CUDA the candidate that prefills fastest here, else the CPU default."""
    if bench.fill_budget is None:
        args = bench.args
        if args.prefill_chunk is not None:
            bench.fill_budget = args.prefill_chunk
        elif bench.device.type != "cuda":
            bench.fill_budget = CPU_FILL_BUDGET
        elif not (candidates := probed_fill_candidates(args.context)):
            bench.fill_budget = FILL_CANDIDATES[0]  # every prompt fills in at most two steps of any budget
        else:
            bench.fill_budget, results = fastest_fill_budget(candidates, lambda b: probe_fill(bench, b))
            bench.info["fill_budget_probe"] = {str(b): r for b, r in results.items()}
            print(f"decode fill budget: {bench.fill_budget} tokens a step (prefill tokens/s by budget: {results})")
    return bench.fill_budget


# ---- the points ------------------------------------------------------------------------------
def run_decode_point(bench: Bench, num_requests: int) -> dict[str, Any]:
    """Fill the engine with ``num_requests`` prompts of ``context`` tokens, then time steady-state decode steps."""
    args, budget = bench.args, fill_budget(bench)
    max_model_len = decode_max_model_len(args, num_requests, budget)
    blocks, cache = sized_cache(bench, num_requests, max_model_len)
    # The timed steps all decode num_requests sequences: one CUDA graph bucket of that size is all they replay
    # (capturing every power of two below it would only lengthen the point's set-up).
    graphs = {"cuda_graph_sizes": (num_requests,)} if str(args.device).startswith("cuda") else {}
    engine = make_engine(bench, max_num_seqs=num_requests, max_num_batched_tokens=max(budget, num_requests),
                         max_model_len=max_model_len, speculative_config=args.speculative, num_cache_blocks=blocks,
                         **graphs)  # fmt: skip
    check_cache_holds(engine, num_requests, max_model_len)
    if args.coin_acceptance is not None:  # the benchmark device: drafts accepted by a seeded coin
        accept_by_coin(engine, args.coin_acceptance, args.seed)
    fill = fill_decode_point(bench, engine, num_requests, budget)
    sequences = [seq for group in engine.requests.values() for seq in group]
    run_steps(engine, args.warmup_steps)
    measured, drafted, extra = _timed_decode(bench, engine, sequences)
    accounting = speculative_accounting(args.nextn, args.accept, num_requests, measured, drafted)
    if drafted is not None:  # the headline counts output tokens, not the verified positions
        measured["tokens_per_s_per_gpu"] = accounting["measured"]["tokens_per_s_per_gpu"]
    return {
        "point_unit": "requests per DP rank",
        **measured,
        "throughput_kind": "output tokens",
        "tokens_per_step_per_user": accounting["measured"]["tokens_per_step_per_user"],
        "tokens_per_s_per_user": accounting["measured"]["tokens_per_s_per_user"],
        "preemptions": engine.scheduler.num_preemptions,
        **fill,
        **extra,
        **accounting,
        "cache": cache,
        "engine": asdict(engine.config),
    }


def fill_decode_point(bench: Bench, engine: LLMEngine, num_requests: int, budget: int) -> dict[str, Any]:
    """Untimed: ``num_requests`` sequences of ``context`` tokens, each past its prefill. ``--fill-prompts`` of them
    are prefilled from distinct random prompts; the others are forks of those (their caches copied on the device
    into blocks of their own, :meth:`LLMEngine.fork_request`), so a 256 x 131,072 point fills in seconds while
    every decode step still reads each sequence's own cache (with speculative decoding, the drafter's rings too)."""
    args = bench.args
    distinct = num_requests if args.fill_prompts == 0 else args.fill_prompts
    distinct = min(distinct, num_requests)
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    prompts = random_prompts(distinct, args.context, bench.model.config.vocab_size, args.seed)
    sources = [engine.add_request(prompt, params) for prompt in prompts]
    sequences = [seq for group in engine.requests.values() for seq in group]
    fill_start, fill_steps = time.perf_counter(), 0
    while not all(seq.output_token_ids for seq in sequences):  # every distinct prompt prefilled once
        checked_step(engine)
        fill_steps += 1
    for index in range(num_requests - distinct):
        engine.fork_request(sources[index % distinct], params)
    return {"fill_steps": fill_steps, "fill_s": time.perf_counter() - fill_start, "fill_budget": budget,
            "fill_prompts": distinct, "fill_forks": num_requests - distinct}  # fmt: skip


def _timed_decode(bench: Bench, engine: LLMEngine, sequences: list) -> tuple[dict, dict | None, dict]:
    """The timed decode steps: their statistics, the drafts they ran (None without speculation), and the rest
    of the record (context range, timed window, collector pauses, the optional profile)."""
    args = bench.args
    shortest = min(seq.num_tokens for seq in sequences)
    sampled_before = sum(len(seq.output_token_ids) for seq in sequences)
    stats_before = replace(engine.spec_stats) if engine.spec_stats is not None else None
    executor = engine.worker.speculative
    graphed_before = executor.graphed_steps if executor is not None else 0
    graphs = executor.graphs if executor is not None else None
    clock = graphs.start_phase_clock() if args.time_spec_phases and graphs is not None else None
    timed, collector, window = timed_steps(engine, args.measure_steps, bench.telemetry_held())
    if clock is not None:
        graphs.phase_clock = None
    if any(seq.is_finished for seq in sequences):
        raise RuntimeError("a sequence finished inside the timed window (a sweep bookkeeping bug)")
    extra = {"context_range": [shortest, max(seq.num_tokens for seq in sequences)], "timed_window": window,
             "gc": collector}  # fmt: skip
    if args.profile_steps:  # after the timing: a profiler session slows what runs after it
        extra["profile"] = profile_steps(lambda: checked_step(engine), args.profile_steps, bench.device,
                                         prepare=lambda: recapture_graphs(engine),
                                         drain=lambda: drain_device(engine))  # fmt: skip
    drafts_per_step = args.speculative.num_speculative_tokens if args.speculative is not None else 0
    measured = step_statistics(timed, expected_tokens=len(sequences) * (1 + drafts_per_step))
    drafted = None
    if stats_before is not None:
        stats = engine.spec_stats
        drafted = {
            "config": asdict(args.speculative),
            "sampled": sum(len(seq.output_token_ids) for seq in sequences) - sampled_before,
            "drafts": stats.num_drafts - stats_before.num_drafts,
            "draft_tokens": stats.num_draft_tokens - stats_before.num_draft_tokens,
            "accepted": stats.num_accepted_tokens - stats_before.num_accepted_tokens,
            "graphed_steps": executor.graphed_steps - graphed_before,
            "coin_acceptance": args.coin_acceptance,
            "phases": clock.medians() if clock is not None else None,
        }
    return measured, drafted, extra


def run_prefill_point(bench: Bench, batch_tokens: int) -> dict[str, Any]:
    """Time steps that each prefill exactly ``batch_tokens`` new tokens of ``context``-token prompts."""
    args = bench.args
    measure, cycle = prefill_measure_steps(args.context, batch_tokens, args.measure_steps)
    slots = math.ceil(batch_tokens / args.context) + 1  # a step may hold a tail, whole prompts and a head
    blocks, cache = sized_cache(bench, slots, args.context + 1)
    engine = make_engine(bench, max_num_seqs=slots, max_num_batched_tokens=batch_tokens,
                         max_model_len=args.context + 1, num_cache_blocks=blocks)  # fmt: skip
    check_cache_holds(engine, slots, args.context + 1)
    total_steps = args.warmup_steps + measure + args.profile_steps
    requests = math.ceil(total_steps * batch_tokens / args.context) + 1  # +1: the last step stays full
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # finish as soon as prefilled
    for prompt in random_prompts(requests, args.context, bench.model.config.vocab_size, args.seed):
        engine.add_request(prompt, params)
    run_steps(engine, args.warmup_steps)
    timed, collector, window = timed_steps(engine, measure)
    extra = {}
    if args.profile_steps:  # after the timing, as for decode
        extra["profile"] = profile_steps(lambda: checked_step(engine), args.profile_steps, bench.device,
                                         drain=lambda: drain_device(engine))  # fmt: skip
    return {
        "point_unit": "batch tokens per step",
        **step_statistics(timed, expected_tokens=batch_tokens),
        "throughput_kind": "uncached input tokens",
        "tokens_per_step_per_user": None,
        "tokens_per_s_per_user": None,
        "preemptions": engine.scheduler.num_preemptions,
        "requests": requests,
        "position_cycle_steps": cycle,
        "covers_full_cycle": measure % cycle == 0,
        "timed_window": window,
        "gc": collector,
        "cache": cache,
        "engine": asdict(engine.config),
        **extra,
    }


def warm_up(bench: Bench) -> None:
    """One short request through every code path before the first point, so lazy set-up is not timed."""
    engine = make_engine(bench, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=32, num_cache_blocks=8)
    engine.add_request(random_prompts(1, 16, bench.model.config.vocab_size, bench.args.seed)[0],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # fmt: skip
    while engine.has_unfinished_requests():
        engine.step()


def sampled_rows(record: dict[str, Any]) -> int:
    """Rows the output head computes in one step: every verified position (decode), else the prompts a step
    finishes (prefill: at least one)."""
    if record["mode"] == "decode":
        return round(record["tokens_per_step"])
    return max(1, record["point"] // record["context"])


def run_point(bench: Bench, point: int) -> dict[str, Any]:
    """One point, with the engine's memory handed back afterwards (the next point sizes its cache from it)."""
    args = bench.args
    try:
        measured = (run_decode_point if args.mode == "decode" else run_prefill_point)(bench, point)
    except torch.OutOfMemoryError as exc:
        raise PointSkipped(f"out of memory: {str(exc).splitlines()[0]}") from None
    finally:
        release_memory(bench.device)
    from dsinfer import __version__

    record = {
        "tag": args.tag,
        "mode": args.mode,
        "point": point,
        "context": args.context,
        **measured,
        "warmup_steps": args.warmup_steps,
        **bench.info,
        "dtype": args.dtype,
        "device": str(bench.device),
        "gpu_name": gpu_name(bench.device),
        "sampling": "greedy, ignore_eos",
        "dp_rank": dp_rank(),
        "world_size": world_size(),
        "seed": args.seed,
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "dsinfer_version": __version__,
        "torch_version": torch.__version__,
    }
    config = bench.model.config
    head = head_ms(config.hidden_size, config.vocab_size, sampled_rows(record), DTYPES[args.dtype], bench.device)
    record["full_depth"] = record_estimate(record, head)
    return record
