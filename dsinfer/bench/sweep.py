"""Steady-state sweeps of the engine, as DeepInfer's ``run_sweep.sh`` draws its prefill and decode Pareto charts.

    dsinfer bench sweep decode  [--model DIR | --config config.json | --flash-layers N [--arch v4|v41]] [--tag TAG]
                                [--context N] [--nextn N] [--accept P] [--points 1,2,4,...]
                                [--speculative-config '{"method": "mtp", "num_speculative_tokens": K}']
                                [--device cuda] [--dtype bfloat16] [--warmup-steps 3] [--measure-steps 10]
                                [--profile-steps 0] [--out-root sweeps] [--cache-gib G] [--prefill-chunk auto]
                                [--telemetry-interval 5] [--compare-published] [--seed 0]
                                [--engram-gib G] [--v41-prefill bounded|exact] [--kv-cache-dtype auto|bf16|fp8]
    dsinfer bench sweep prefill ... (same options; --nextn / --accept do not apply)
    dsinfer bench sweep encoder ... (images per batch: :mod:`dsinfer.bench.encoder_sweep`)
    scripts/run_sweep.sh decode ce-128k 131072 3 0.75      # the positional form
    scripts/run_sweep.sh prefill pe-128k 131072

Without a model option the embedded default model runs (context 256, small points): a CPU check of the
tool, not a performance number. ``--config`` or ``--flash-layers N`` build random weights, so real shapes can be
measured without the checkpoint: ``--arch v4`` (default) every V4-Flash width, N layers cycling window / CSA /
HCA; ``--arch v41`` every V4.1-Flash width (384 routed experts), N layers in the release's roles (window +
Engram, the ratio-2 encoder, the ratio-1 decoder: :func:`dsinfer.bench.v41_slice.v41_slice_config`). V4.1's
Engram tables (``--engram-gib``, default 8 GiB; a V4.1 ``--config`` keeps its own size unless given) are random
rows in host shared memory read through the real store and the host fetcher, hashed by a synthetic compressed
vocabulary (no tokenizer ships with random weights). V4.1 prompts prefill with the bounded CED replay unless
``--v41-prefill exact`` (or speculative decoding, whose drafts need every position) says otherwise.
``--kv-cache-dtype fp8`` runs the engine with V4's indexer keys stored as FP8 codes (the engine's option), so one
sweep per value compares the two storages at a context.

Before the first point the sweep prints what one sequence's caches take at the context, per layer kind, in
bf16 and FP8 storage (:mod:`dsinfer.bench.cache_budget`), the cache budget and how many sequences fit it; a
point that cannot fit is refused with one message (recorded in summary.json's ``skipped``) instead of running
out of memory, and each engine's cache holds exactly its point's sequences, leaving the rest for the work.

What one point measures (one engine per point, one process = one DP rank = one GPU):

* decode, point = requests per DP rank (n): n sequences whose prompts are ``--context`` random tokens are
  prefilled first (not timed, chunk budget ``--prefill-chunk``; ``auto``: on CUDA the budget of 8,192, 16,384
  and 32,768 tokens whose prefill step runs the most tokens per second here, found once per sweep); then
  ``--warmup-steps`` decode steps are run and discarded and ``--measure-steps`` decode steps are timed, each
  ``LLMEngine.step()`` on its own
  (wall clock around the call; the engine synchronises CUDA after the forward, and sampling reads the tokens
  back, so a step's time is the GPU's too). Sequences never finish during the timed steps.
* prefill, point = batch tokens per step (p): the chunked-prefill budget is p and the queue holds enough
  ``--context``-token prompts (each generating one token, then finishing) that every timed step prefills
  exactly p new tokens, spread over positions 0..context as in a long prompt. Since a step at position 100k
  costs more than one at 0, the measured steps are rounded up to whole cycles of the position pattern
  (``lcm(p, context) / p`` steps) so the mean is not biased; ``covers_full_cycle`` says whether that held.
  Prefix caching is off: every input token is uncached.

Headline numbers use the mean over the timed steps (total tokens / total time is what a throughput is;
prefill steps differ systematically by position); the median and spread are recorded beside it. The device is
drained before the first timed step and inside the last, so the timed steps hold exactly their own work. A
step's own time is the host's wait in it: under overlap scheduling a prefill chunk whose prompt does not finish
returns at once, and the step that finishes the prompt waits for the chunks before it, so a prefill point's
median and p90 say where the host waited, not what a chunk costs.

Output, written only by dp_rank 0 (``DP_RANK``, else ``RANK``; others run and print but write nothing):
``<out-root>/<tag>/results.jsonl`` (one JSON object per point, appended as each point finishes),
``pareto.png``, ``summary.json`` (command, skipped points, telemetry summary) and, on CUDA with NVML,
``telemetry.csv`` (see :mod:`dsinfer.bench.telemetry`). Decode points hold the sampler over their timed steps:
a step that meets an NVML read takes milliseconds longer, and a step is too short for a reading to describe.

Fields of each results.jsonl record:

==========================  =======================================================================================
tag, mode                   the sweep's tag; "decode" or "prefill"
point, point_unit           the swept value: "requests per DP rank" (decode) or "batch tokens per step" (prefill)
context                     prompt length in tokens (decode: context at the first fill; see context_range)
ms_per_step                 mean wall time of one timed step, milliseconds (= 1000 * measured_s / steps)
median_ms_per_step,
min_ms_per_step,
max_ms_per_step,
p90_ms_per_step             the spread of the timed steps
steps, warmup_steps         timed steps; steps run and discarded before them
measured_s                  total seconds of the timed steps
tokens_per_step             tokens computed per step on this rank: n (decode, one per sequence) or p (prefill)
tokens_per_s_per_gpu        tokens_per_step / (ms_per_step / 1000): output tokens/s (decode, measured
                            accounting) or uncached input tokens/s (prefill) of this rank's GPU (or CPU)
throughput_kind             "output tokens" or "uncached input tokens": what tokens_per_s_per_gpu counts
tokens_per_step_per_user    decode: tokens_per_step / n (1.0: no drafts run); prefill: null
tokens_per_s_per_user       decode: tokens_per_step_per_user / (ms_per_step / 1000); prefill: null
irregular_steps             timed steps that did not compute exactly tokens_per_step tokens (0 = clean)
preemptions                 scheduler preemptions during the point (0 = clean)
step_time_share             schedule / model / postprocess shares of the timed time (``LLMEngine.last_step``)
context_range               decode: [shortest sequence at the first timed step, longest at the last]
fill_steps, fill_s,
fill_budget                 decode: steps and seconds of the untimed prefill that filled the engine, its budget
cache                       storage ("bf16" / "fp8"), bytes_per_sequence, budget_bytes, budget_from and
                            sequences_that_fit of the point's cache (:mod:`dsinfer.bench.cache_budget`)
full_depth                  the step scaled to the released model's depth (:mod:`dsinfer.bench.published`):
                            release_layers, head_ms, per_layer_ms, ms_per_step, tokens_per_s_per_gpu and (decode,
                            under the accounting DeepInfer's chart uses) tokens_per_s_per_user
requests                    prefill: prompts queued for the point
position_cycle_steps,
covers_full_cycle           prefill: lcm(p, context) / p, and whether the timed steps are whole cycles
nextn, accept, speculative  decode: drafts per step and per-token acceptance given; speculative is the
                            engine's speculative config when --speculative-config runs drafts, "not run,
                            measured = no drafts" when only --nextn is given, "off (nextn = 0)" otherwise
measured                    decode: the measured accounting: tokens actually sampled per step per user,
                            tokens_per_s_per_user, tokens_per_s_per_gpu (equal to the headline fields); with
                            drafts also tau (1 + accepted drafts per verify round, from the engine's counters),
                            drafts and accepted (the counts over the timed steps), graphed_steps (timed steps
                            whose verify and drafting replayed CUDA graphs, or their static path on the CPU)
assumed                     decode: the official accounting, tokens_per_step_per_user = 1 + nextn * accept
                            (tau; 3.25 for nextn 3, accept 0.75) applied to the measured step time:
                            tokens_per_s_per_user = tau / s_per_step, tokens_per_s_per_gpu = n * tau / s_per_step;
                            also chained_tokens_per_step = 1 + accept + ... + accept**nextn (the expectation
                            when a rejected draft discards the drafts after it) and a note on its step time
model, model_source,
weights, arch               what ran: a label, where it came from, "checkpoint" or "random", "v4" or "v41"
engram_table_gib,
v41_prefill                 V4.1: its Engram tables' size, and how its prompts prefill ("bounded" / "exact")
num_layers, hidden_size,
n_routed_experts,
vocab_size                  the model's shape
dtype, device, gpu_name     compute dtype, torch device, GPU name (torch / NVML) or "cpu"
engine                      every EngineConfig option of the point's engine
gc                          Python's collections inside the timed steps (per generation), their ms and longest
step_ms                     each timed step's time, in order
profile                     decode with --profile-steps N: N more steps profiled after the timed ones (kernels,
                            busy / span / idle ms, each also per step, the costliest names and largest gaps:
                            :func:`dsinfer.bench.step_profile.timeline_summary`); absent otherwise
sampling                    "greedy, ignore_eos"
dp_rank, world_size         from DP_RANK / RANK and DP_SIZE / WORLD_SIZE (default 0 and 1)
seed                        seed of the random prompts (and random weights)
timestamp                   UTC, ISO 8601, when the point finished
dsinfer_version,
torch_version               software that produced the numbers
==========================  =======================================================================================

Speculative decoding: DeepInfer's decode chart fixes nextn=3, assumes 75% per-token acceptance, times steps
as if every draft were accepted (each step verifies 1 + nextn tokens per sequence) and credits
tau = 1 + nextn * accept = 3.25 tokens per step. The ``assumed`` accounting applies that tau to *our* measured
step. With ``--speculative-config`` the engine really drafts (V4's MTP layer; random weights get an MTP layer
of random weights too) and verifies 1 + K tokens per sequence per step, so the step time is the real one and
``measured`` holds the real tau (about 1 on random weights, which draft badly); ``--nextn`` defaults to K there.
``--coin-acceptance 0.75`` (a benchmark device, :mod:`dsinfer.bench.coin_acceptance`) accepts each draft by a
seeded coin instead, so random weights time the verify steps the assumed accounting counts.
V4.1 drafts with its DSpark stages: ``'{"method": "dspark", "num_speculative_tokens": 3}'``.
Without it, ``--nextn`` only feeds the assumed accounting of a step that runs no drafts.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dsinfer.bench.cache_budget import cache_budget, describe_kinds, sequences_that_fit
from dsinfer.bench.published import comparison_lines
from dsinfer.bench.sweep_model import Bench, build_bench, cache_kinds, check_fits_model
from dsinfer.bench.sweep_options import dp_rank, parse_args, world_size
from dsinfer.bench.sweep_points import PointSkipped, fill_budget, release_memory, run_point, warm_up
from dsinfer.config import ConfigError
from dsinfer.kv.sequence_bytes import format_bytes, sequence_bytes
from dsinfer.models.loader import CheckpointError
from dsinfer.tokenizer import TokenizerLoadError

__all__ = ["dp_rank", "main", "run_sweep"]


def _describe(record: dict[str, Any]) -> str:
    line = f"{record['mode']} point {record['point']:>6}: {record['ms_per_step']:9.2f} ms/step "
    line += f"(median {record['median_ms_per_step']:.2f}, p90 {record['p90_ms_per_step']:.2f}), "
    line += f"{record['tokens_per_s_per_gpu']:11.1f} tokens/s/GPU"
    if record["mode"] == "decode":
        line += f", {record['tokens_per_s_per_user']:8.1f} tokens/s/user"
        if record["nextn"] > 0:
            line += f" (assumed accounting: {record['assumed']['tokens_per_s_per_user']:.1f})"
        real = record.get("measured", {})
        if "graphed_steps" in real:
            line += f", tau {real['tau']:.2f}, {real['graphed_steps']}/{record['steps']} steps graphed"
    utilization = (record.get("telemetry") or {}).get("columns", {}).get("gpu_util_percent")
    if utilization is not None:
        line += f", GPU busy {utilization['mean']:.0f}% ({record['telemetry']['samples']} samples)"
    for kernel in (record.get("profile") or {}).get("top", [])[:8]:
        line += f"\n    {kernel['ms_per_step']:8.3f} ms/step  {kernel['calls_per_step']:6.1f} calls  {kernel['name']}"
    return line


def print_cache_report(bench: Bench) -> None:
    """What one sequence's caches take at the sweep's context, per layer kind in both storages, the budget, and
    how many sequences fit it (at the engine's storage): printed before any point runs."""
    args = bench.args
    tokens = args.context + 1 if args.mode == "prefill" else args.context + args.warmup_steps + args.measure_steps
    tables, storage, engine_kinds = cache_kinds(bench, tokens)
    release_memory(bench.device)
    budget = cache_budget(args.cache_gib, bench.device)
    per_sequence = sequence_bytes(engine_kinds)
    for line in describe_kinds(tables, tokens, storage):
        print(line)
    fit = sequences_that_fit(budget[0], per_sequence)
    print(f"cache budget {format_bytes(budget[0])} ({budget[1]}): {fit} sequences of {tokens:,} tokens fit "
          f"({format_bytes(per_sequence)} each as the engine stores them)")  # fmt: skip
    if "engram_table_gib" in bench.info:
        print(f"Engram tables: {format_bytes(bench.info['engram_table_gib'] * 2**30)} in host shared memory")
    bench.info["cache_per_sequence"] = {
        name: {kind.kind: {"layers": kind.layers, "bytes_per_layer": kind.per_layer} for kind in kinds}
        for name, kinds in tables.items()
    }


def run_sweep(args: argparse.Namespace, argv: list[str]) -> int:
    rank = dp_rank()
    world_size()  # a bad value fails now, not after the first point
    writes = rank == 0
    out_dir = Path(args.out_root) / args.tag
    if not writes:
        print(f"sweep: dp_rank {rank} runs the points but writes nothing (only dp_rank 0 writes)", file=sys.stderr)
    bench = build_bench(args)
    try:
        check_fits_model(args, bench.model.config)
        warm_up(bench)
        print_cache_report(bench)
        if args.mode == "decode":
            fill_budget(bench)
        return _run_points(bench, out_dir, writes, argv)
    finally:
        bench.close()


def _start_telemetry(bench: Bench, out_dir: Path, writes: bool):
    from dsinfer.bench.telemetry import TelemetrySampler

    args = bench.args
    if not writes or args.telemetry_interval <= 0:
        return None
    if bench.device.type != "cuda":
        print("telemetry: off, the sweep runs on the CPU; no telemetry.csv written", file=sys.stderr)
        return None
    sampler = TelemetrySampler(out_dir / "telemetry.csv", args.telemetry_interval, [bench.device.index or 0])
    bench.sampler = sampler if sampler.start() else None
    return sampler


def _run_points(bench: Bench, out_dir: Path, writes: bool, argv: list[str]) -> int:
    from dsinfer.bench.telemetry import summarize

    args = bench.args
    results_path = out_dir / "results.jsonl"
    if writes:
        out_dir.mkdir(parents=True, exist_ok=True)
        results_path.write_text("")
    sampler = _start_telemetry(bench, out_dir, writes)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    records, skipped = [], []
    try:
        for point in args.points:
            try:
                record = run_point(bench, point)
                if sampler is not None and sampler.active:  # the GPU while this point's timed steps ran (rows
                    # whose reading reaches back before the window, i.e. taken in its first interval, left out)
                    start, end = (t - sampler.started_at for t in record["timed_window"])
                    record["telemetry"] = summarize(sampler.path, (start, end), lookback_s=args.telemetry_interval)
            except PointSkipped as exc:
                print(f"{args.mode} point {point:>6}: skipped, {exc}", file=sys.stderr)
                skipped.append({"point": point, "reason": str(exc)})
                continue
            print(_describe(record), flush=True)
            records.append(record)
            if writes:
                with results_path.open("a") as handle:
                    handle.write(json.dumps(record) + "\n")
    finally:
        if sampler is not None:
            sampler.stop()
    if records:
        print("\n".join(comparison_lines(records)))
    if not writes:
        return 0 if records else 1
    return _write_summary(bench, out_dir, argv, started, records, skipped, sampler)


def _write_summary(
    bench: Bench,
    out_dir: Path,
    argv: list[str],
    started: str,
    records: list[dict[str, Any]],
    skipped: list[dict[str, Any]],
    sampler: Any,
) -> int:
    """summary.json and pareto.png of a finished sweep (dp_rank 0); 1 when no point could run."""
    from dsinfer.bench.telemetry import summarize

    args = bench.args
    summary = {
        "tag": args.tag,
        "mode": args.mode,
        "argv": argv,
        "started": started,
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "points": [r["point"] for r in records],
        "skipped": skipped,
        "results": "results.jsonl",
        "pareto": None,
        "telemetry": None,
        "cache_per_sequence": bench.info.get("cache_per_sequence"),
        "fill_budget": bench.fill_budget,
    }
    if sampler is not None and sampler.off_reason is None:
        summary["telemetry"] = {"file": sampler.path.name, **summarize(sampler.path)}
    elif sampler is not None:
        summary["telemetry"] = {"off": sampler.off_reason}
    if records:
        summary["pareto"] = _draw(records, out_dir / "pareto.png", args.compare_published)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if summary["telemetry"] is not None:
        print(f"telemetry: {json.dumps(summary['telemetry'])}")
    print(f"wrote {out_dir}/ ({len(records)} points, {len(skipped)} skipped)")
    if not records:
        print("sweep: no point could run; see the reasons above", file=sys.stderr)
        return 1
    return 0


def _draw(records: list[dict[str, Any]], path: Path, compare_published: bool) -> str | None:
    """Draw the Pareto PNG; a missing matplotlib costs the chart, never the measured points."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("sweep: matplotlib is not installed; pareto.png not drawn", file=sys.stderr)
        return None
    from dsinfer.bench.pareto import draw_pareto

    return draw_pareto(records, path, compare_published).name


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["encoder"]:  # images per batch through the V4.1 image encoder: its own options
        from dsinfer.bench.encoder_sweep import main as encoder_main

        return encoder_main(argv[1:])
    try:
        args = parse_args(argv)
        return run_sweep(args, argv)
    except (ValueError, ConfigError, CheckpointError, TokenizerLoadError) as exc:
        print(f"dsinfer bench sweep: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
