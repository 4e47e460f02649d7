"""The verify-step table: ms per speculative verify step against the plain graphed decode step, one process.

    python benchmarks/spec_verify_step.py                       # V4 (MTP) and V4.1 (DSpark) 4-layer slices, CUDA
    python benchmarks/spec_verify_step.py --arch v4 --requests 1,32 --k 3 --contexts 256,131072
    python benchmarks/spec_verify_step.py --tiny                # tiny checkpoints on the CPU (what the test runs)
    python benchmarks/spec_verify_step.py --arch v4 --k 3 --draft-map-size 32768   # MTP drafts from 32,768 head rows

Each model is built once, as ``dsinfer bench sweep decode --flash-layers 4`` builds it (random weights at
V4-Flash / V4.1-Flash widths; the V4 slice gets a random MTP layer, the V4.1 slice its DSpark stages). For every
context and request count the sweep's decode point (:func:`dsinfer.bench.sweep_points.run_decode_point`: fill
the prompts untimed, warm up, time steady steps; on CUDA one graph bucket of the request count) runs plain, then
with ``num_speculative_tokens`` K for every ``--k``. Random weights draft badly, so drafts are accepted by the
benchmark's seeded coin (:mod:`dsinfer.bench.coin_acceptance`, ``--coin`` 0.75 by default: the official
accounting's acceptance); the verify forward, snapshot, rollback and drafting all run as with real drafts.
``--coin 0`` times real judging instead (tau about 1).

Columns: ``plain ms`` (a plain decode step), ``verify ms`` (a verify step: K + 1 positions a sequence, drafts
for the next), ``ratio`` (verify / plain, same process, same model), ``tau`` (tokens a sequence gets per verify
step), ``tok/s x`` (output tokens per second against plain's), ``host share`` (the shares of the step the engine
spends scheduling and processing outputs, plain and verify: a verify step reads its results on the host before the
next can be planned, so its host work is not hidden behind the GPU's), and the ``replays``' device time
(:mod:`dsinfer.speculative.phase_clock`): ``verify`` (snapshot, the target forward over the K + 1 positions, judge;
``forward_ratio`` in the JSON divides it by the plain step) and ``draft`` (rollback, the next drafts), and the
``expert bytes floor``: the weight bytes a verify forward must read against a plain one's when the router spreads
rows over experts uniformly, as the slices' random weights do (:func:`expert_bytes_floor`; a trained router whose
drafts share experts reads less). Issue 46's bar: K = 3 at most 1.3x plain at one request and 1.6x at 32.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from dsinfer.bench.sweep_model import build_bench
from dsinfer.bench.sweep_options import parse_args as parse_sweep_args
from dsinfer.bench.sweep_points import run_decode_point
from dsinfer.models.tiny import make_tiny_checkpoint

METHODS = {"v4": "mtp", "v41": "dspark"}


def _sweep_argv(arch: str, options: argparse.Namespace, checkpoint: str | None, k: int) -> list[str]:
    """The sweep options of one model's points (its speculative config is the largest K: the drafter it builds;
    MTP with ``options.draft_map``, a ``draft_token_map`` file, when one was asked for)."""
    spec = {"method": METHODS[arch], "num_speculative_tokens": k}
    if arch == "v4" and options.draft_map is not None:
        spec["draft_token_map"] = options.draft_map
    spec = json.dumps(spec)
    argv = ["decode", "--device", options.device, "--speculative-config", spec, "--v41-prefill", "exact",
            "--warmup-steps", str(options.warmup_steps), "--measure-steps", str(options.measure_steps),
            "--prefill-chunk", str(options.prefill_chunk), "--seed", "0", "--time-spec-phases",
            "--profile-steps", str(options.profile_steps)]  # fmt: skip
    if checkpoint is not None:
        argv += ["--model", checkpoint, "--cache-gib", "0.0625"]
    else:
        argv += ["--flash-layers", str(options.layers), "--arch", arch]
    return argv


def _point(bench, requests: int, speculative, coin: float) -> dict:
    """One decode point: ms a step and tokens a sequence per step (plain when ``speculative`` is None)."""
    args = bench.args
    args.speculative, args.nextn = speculative, speculative.num_speculative_tokens if speculative else 0
    args.coin_acceptance = coin if speculative is not None and coin > 0 else None
    record = run_decode_point(bench, requests)
    tau = record["measured"].get("tau", 1.0) if speculative is not None else 1.0
    shares, measured = record.get("step_time_share") or {}, record["measured"]
    return {"ms": record["ms_per_step"], "tau": tau, "graphed": measured.get("graphed_steps"),
            "host_share": shares.get("schedule", 0.0) + shares.get("postprocess", 0.0),
            "verify_forward_ms": measured.get("verify_ms"), "draft_ms": measured.get("draft_ms"),
            "profile": record.get("profile")}  # fmt: skip


def measure_model(
    arch: str, options: argparse.Namespace, checkpoint: str | None = None, rows: list[dict] | None = None
) -> list[dict]:
    """Every (context, requests, K) row of one model, plain first, each appended to ``rows`` and reported
    (:func:`report_row`) as soon as it is measured."""
    ks = sorted(options.k)
    args = parse_sweep_args(_sweep_argv(arch, options, checkpoint, ks[-1]))
    spec = args.speculative
    bench = build_bench(args)
    rows = [] if rows is None else rows
    try:
        for context in options.contexts:
            args.context, bench.fill_budget = context, None
            for requests in options.requests:
                plain = _point(bench, requests, None, 0.0)
                for k in ks:
                    point = _point(bench, requests, replace(spec, num_speculative_tokens=k), options.coin)
                    row = {"arch": arch, "method": spec.method, "context": context, "requests": requests, "k": k,
                           "plain_ms": plain["ms"], "verify_ms": point["ms"], "ratio": point["ms"] / plain["ms"],
                           "tau": point["tau"], "speedup": point["tau"] * plain["ms"] / point["ms"],
                           "graphed_steps": point["graphed"], "coin": options.coin,
                           "plain_host_share": plain["host_share"], "verify_host_share": point["host_share"],
                           "verify_forward_ms": point["verify_forward_ms"], "draft_ms": point["draft_ms"],
                           "forward_ratio": _ratio(point["verify_forward_ms"], plain["ms"]),
                           "expert_bytes_floor": expert_bytes_floor(bench.model, requests, k)}  # fmt: skip
                    if options.profile_steps:
                        row["profiles"] = {"plain": plain["profile"], "verify": point["profile"]}
                    rows.append(row)
                    report_row(row, rows, options.out)
    finally:
        bench.close()
    return rows


def weight_bytes(model) -> tuple[float, float, int]:
    """(bytes a forward reads whatever it routes, bytes of one routed expert of one layer, routed layers) of the
    target's weights on the device: the routed experts' tensors (``routed_w13``, ``routed_w2`` and their scales)
    apart; the input embedding (a few rows a step) and the drafter's layers (``mtp``) left out."""
    fixed, routed, layers = 0.0, 0.0, 0
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        size = tensor.numel() * tensor.element_size()
        if name.startswith("mtp.") or "embed" in name:
            continue
        if ".routed_w" in name:
            routed += size
            layers += name.endswith(".routed_w13")
        else:
            fixed += size
    experts = model.config.n_routed_experts
    return fixed, (routed / layers / experts if layers else 0.0), layers


def expert_bytes_floor(model, requests: int, k: int) -> float:
    """How many times a verify forward of ``requests`` x (K + 1) rows must read the weight bytes of a plain one of
    ``requests`` rows when the router picks each row's experts uniformly at random (the slices' random weights):
    each layer reads the experts its rows touch, ``n (1 - (1 - top_k / n) ** rows)`` of them in expectation."""
    fixed, per_expert, layers = weight_bytes(model)
    n, top_k = model.config.n_routed_experts, model.config.num_experts_per_tok

    def read(rows: int) -> float:
        return fixed + layers * per_expert * n * (1 - (1 - top_k / n) ** rows)

    return read(requests * (k + 1)) / read(requests)


def report_row(row: dict, rows: list[dict], out: str | None) -> None:
    """Print ``row`` (and its profiles' costliest kernels) and rewrite ``out`` with every row so far, so that a run
    stopped by a time limit keeps what it measured."""
    print(_line(row), flush=True)
    for name, profile in (row.get("profiles") or {}).items():
        if not profile:  # a point that recorded none
            continue
        per_step = profile.get("per_step", {})
        top = ", ".join(f"{entry['name'][:48]} {entry['ms_per_step']:.3f}" for entry in profile.get("top", [])[:6])
        print(f"    {name}: {per_step.get('kernels', 0):.0f} kernels, {per_step.get('busy_ms', 0):.3f} ms busy a step; "
              f"{top}", flush=True)  # fmt: skip
    if out:
        Path(out).write_text(json.dumps(rows, indent=1))


def _ratio(part_ms: float | None, plain_ms: float) -> float | None:
    return None if part_ms is None else part_ms / plain_ms


def _ms(value: float | None) -> str:
    return "   -   " if value is None else f"{value:7.3f}"


def _line(row: dict) -> str:
    return (f"{row['arch']:4} {row['method']:6} ctx={row['context']:6} requests={row['requests']:3} K={row['k']}  "
            f"plain ms={row['plain_ms']:8.3f}  verify ms={row['verify_ms']:8.3f}  ratio={row['ratio']:5.2f}  "
            f"tau={row['tau']:4.2f}  tok/s x={row['speedup']:4.2f}  graphed={row['graphed_steps']}  "
            f"host share plain / verify={row['plain_host_share']:.2f} / {row['verify_host_share']:.2f}  "
            f"replays: verify {_ms(row['verify_forward_ms'])} ms, draft {_ms(row['draft_ms'])} ms  "
            f"expert bytes floor={row['expert_bytes_floor']:.2f}x")  # fmt: skip


def _ints(text: str) -> list[int]:
    return [int(value) for value in text.split(",") if value]


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="v4,v41", help="comma list: v4 (MTP), v41 (DSpark)")
    parser.add_argument("--k", type=_ints, default=[1, 3, 5], help="num_speculative_tokens values")
    parser.add_argument("--requests", type=_ints, default=[1, 32, 64])
    parser.add_argument("--contexts", type=_ints, default=[256], help="prompt tokens (131072: a long fill)")
    parser.add_argument("--layers", type=int, default=4, help="--flash-layers of the slices")
    parser.add_argument("--coin", type=float, default=0.75, help="draft acceptance by the seeded coin; 0: judge")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--measure-steps", type=int, default=20)
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="profile this many steps of each point after the timed ones (kernels a step)",
    )
    parser.add_argument("--prefill-chunk", type=int, default=8192, help="fill tokens a step (skips the probe)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny checkpoints instead of the slices (CPU test)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--draft-map-size", type=int, default=0,
                        help="MTP drafts from a draft_token_map of this many ids (the lowest; the coin accepts them "
                        "alike): each draft reads that many head rows (0: the whole head)")  # fmt: skip
    options = parser.parse_args(argv)
    if options.tiny and options.contexts == [256]:
        options.contexts = [24]
    return options


def main(argv: list[str] | None = None) -> list[dict]:
    options = parse_options(argv)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        options.draft_map = None
        if options.draft_map_size > 0:
            options.draft_map = f"{root}/draft_token_map.json"
            Path(options.draft_map).write_text(json.dumps(list(range(options.draft_map_size))))
        for arch in options.arch.split(","):
            checkpoint = None
            if options.tiny:
                block = {"dspark_block_size": 5} if arch == "v41" else {}
                checkpoint = str(make_tiny_checkpoint(f"{root}/{arch}", seed=0, arch=arch, **block))
            measure_model(arch, options, checkpoint, rows)
    return rows


if __name__ == "__main__":
    main()
