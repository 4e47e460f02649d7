"""vLLM beside dsinfer on the same GPU, the same slice, the same run: one table of both engines' figures.

    python3 benchmarks/peers/vllm_slice.py --out /tmp/vllm-slice [--layers 4] [--mtp both] [--only both] [--long]
    python3 benchmarks/peers/vllm_slice.py --tiny --only dsinfer --out DIR      # the harness on a CPU, tiny model
    python3 benchmarks/peers/vllm_slice.py --out DIR --profile [--profile-top 15]  # and where each row's time goes

The model is dsinfer's ``--flash-layers N`` slice (every V4-Flash width, layers cycling window / CSA / HCA, the
first MoE layer hash-routed, routed experts FP4, the release's FP8 block quantisation declared) written as one
``config.json`` that both engines read; each engine draws dummy weights (vLLM ``load_format="dummy"``, dsinfer
``load_format="dummy"``). vLLM's dummy routers would send nearly every token to the same experts (one shared
selection bias outweighs their logits), so its worker redraws them right after start-up
(``slice_engines.spread_dummy_routing``): both engines then read the expert bytes a spread router reads. Each
engine runs in a child process of its own (``slice_engines.py``), vLLM's first, then dsinfer's, for each MTP
setting and point set, always in that order; the children share nothing but the model directory. Points and
their definitions: ``slice_timing.py``; both engines are timed by the same code.

The table gives, per point, vLLM's and dsinfer's figure and their ratio as dsinfer's speed over vLLM's (prefill
tokens/s over tokens/s; decode vLLM's ms/step over dsinfer's), then the exact vLLM configuration, the versions
and the GPU. A point an engine cannot run says why in its row. Results accumulate in ``OUT/results.json``: a run
with ``--only dsinfer`` after one with ``--only vllm`` (same ``--out``, same machine) prints both columns.

vLLM comes from the peer kit's install (``--vllm-site``, default the kit's ``/tmp/vllm-site``); dsinfer from this
checkout. ``VLLM_DEEP_GEMM_WARMUP`` defaults to ``skip`` here: DeepGEMM then compiles each GEMM shape at its first
use, which is inside the untimed warm-up runs that precede every timed one, instead of over every token count up
to the step budget at start-up.

``--profile``: each child, once it has timed all its points, runs each point's work once more under its engine's
profiler (``slice_profile.py``; the long-context points are profiled over the steps right after their timed
window) and records per row the top kernels by GPU time per step (name, calls, ms per step, share of the step)
and how much of the step the GPU was busy (``slice_trace.py``). The table is then followed by a "top kernels"
section, both engines side by side per row. Traces stay in ``OUT/profiles/<child>/``. A child profiles only
while its time limit allows: the points it has no time left for say so in their row.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from slice_table import merge_record, render_profiles, render_table  # noqa: E402
from slice_timing import DECODE_TOKENS, DEFINITIONS, STREAM_WARM_TOKENS, default_points, long_points  # noqa: E402

ENGINES = ("vllm", "dsinfer")
MIN_CHILD_SECONDS = 20  # a child given less than this could not even start an engine


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="results.json, table.md, child logs and the model go here")
    parser.add_argument("--layers", type=int, default=4, help="layers of the --flash-layers slice (default 4)")
    parser.add_argument("--prefill", default="4096,16384", help="prefill prompt lengths")
    parser.add_argument("--batches", default="1,32,256", help="decode requests")
    parser.add_argument("--contexts", default="256,4096", help="decode prompt lengths")
    parser.add_argument("--long", action="store_true", help="also decode at --long-context (stream method)")
    parser.add_argument("--long-only", action="store_true", help="only the --long points")
    parser.add_argument("--long-batches", default="1,64")
    parser.add_argument("--long-context", type=int, default=131072)
    parser.add_argument("--mtp", choices=["0", "1", "both"], default="both", help="MTP K = 1 off, on, or both")
    parser.add_argument("--only", choices=["vllm", "dsinfer", "both"], default="both")
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS)
    parser.add_argument("--gpu-util", type=float, default=0.85, help="both engines' gpu_memory_utilization")
    parser.add_argument("--child-timeout", type=float, default=540.0, help="seconds per engine child at most")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the whole run: a child gets at most what is left, and none starts with less than 20 s left",
    )
    parser.add_argument("--vllm-site", default="/tmp/vllm-site", help="where the kit installed vLLM")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the children run")
    parser.add_argument("--tiny", action="store_true", help="dsinfer's tiny V4 on the CPU, small points")
    parser.add_argument("--profile", action="store_true", help="after timing, profile each point once more")
    parser.add_argument("--profile-top", type=int, default=15, help="kernels shown per engine and row (default 15)")
    args = parser.parse_args(argv)
    try:
        args.prefill, args.batches, args.contexts, args.long_batches = (
            _positive_list(flag, getattr(args, flag)) for flag in ("prefill", "batches", "contexts", "long_batches")
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.layers < 1 or args.decode_tokens < 1 or args.long_context < 1 or args.profile_top < 1:
        parser.error("--layers, --decode-tokens, --long-context and --profile-top must be positive")
    if args.tiny:  # small enough for a CPU in seconds
        args.prefill, args.batches, args.contexts, args.long_context = [32, 64], [1, 2], [16], 48
        args.decode_tokens, args.long_batches = min(args.decode_tokens, 4), [1, 2]
    return args


def _positive_list(flag: str, text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"--{flag.replace('_', '-')}: expected comma-separated positive integers, got {text!r}")
    return values


def point_sets(args: argparse.Namespace) -> dict[str, list]:
    """The point sets, each one engine child: the regular points, and the long-context decode points (their own
    engine: a 131k-token model length and its cache)."""
    sets = {}
    if not args.long_only:
        sets["main"] = default_points(args.prefill, args.batches, args.contexts)
    if args.long or args.long_only:
        sets["long"] = long_points(args.long_batches, args.long_context, profiled=args.profile)
    return sets


def child_env(engine: str, args: argparse.Namespace) -> dict[str, str]:
    """vLLM's child sees the kit's site (and what its .pth files add) and not this checkout; dsinfer's the checkout."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if engine == "dsinfer":
        env["PYTHONPATH"] = str(REPO)
        return env
    listed = Path(args.vllm_site) / "pythonpath"
    env["PYTHONPATH"] = listed.read_text().strip() if listed.is_file() else args.vllm_site
    env.setdefault("VLLM_DEEP_GEMM_WARMUP", "skip")
    return env


def child_command(engine: str, mtp: int, files: dict[str, Path], model_dir: Path, args, deadline: float) -> list[str]:
    """The child's command line; ``files["profiles"]``: where a profiled child writes its traces; ``deadline``:
    the ``time.time()`` of its limit, which its profiles keep clear of."""
    options = {"--engine": engine, "--model-dir": model_dir, "--points": files["points"], "--result": files["result"],
               "--mtp": mtp, "--decode-tokens": args.decode_tokens, "--gpu-util": args.gpu_util,
               "--device": "cpu" if args.tiny else "cuda"}  # fmt: skip
    if args.profile:
        options.update({"--profile-dir": files["profiles"], "--profile-top": args.profile_top})
    if args.profile and deadline != float("inf"):
        options["--deadline"] = f"{deadline:.3f}"
    return [args.python, str(HERE / "slice_engines.py"), *(str(x) for pair in options.items() for x in pair)]


def run_limited(command: list[str], env: dict[str, str], log: Path, limit: float) -> int | None:
    """Run ``command`` in a process group of its own (vLLM's engine starts processes of its own); past ``limit``
    seconds stop the whole group, so nothing of it keeps GPU memory from the next child. None: it was stopped."""
    with log.open("w") as stderr:
        child = subprocess.Popen(command, env=env, stderr=stderr, start_new_session=True)
        try:
            return child.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            return None
        finally:  # past the limit, or this run itself stopped (SIGTERM from `timeout`): the group goes too
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()


def run_child(engine: str, mtp: int, set_name: str, points: list, model_dir: Path, args) -> dict[str, Any]:
    """One engine child under its time limit (the smaller of --child-timeout and what --budget has left); its
    result file, or a record saying why there is none."""
    out, name = Path(args.out), f"{engine}-mtp{mtp}-{set_name}"
    files = {kind: out / f"{name}.{kind}.json" for kind in ("points", "result")}
    files["profiles"] = out / "profiles" / name
    files["points"].write_text(json.dumps([p.as_dict() for p in points]))
    files["result"].unlink(missing_ok=True)
    limit = min(args.child_timeout, args.deadline - time.time())
    base = {"engine": engine, "mtp": mtp, "rows": {}, "set": set_name, "labels": [p.label for p in points],
            "units": [p.unit for p in points]}  # fmt: skip
    if limit < MIN_CHILD_SECONDS:
        print(f"=== {name}: not started, {max(limit, 0):.0f} s of the run's budget left", flush=True)
        return {**base, "error": "not started: the run's --budget was spent"}
    print(f"=== {name}: {len(points)} points, limit {limit:.0f} s", flush=True)
    start, log = time.time(), out / f"{name}.log"
    command = child_command(engine, mtp, files, model_dir, args, start + limit)
    code = run_limited(command, child_env(engine, args), log, limit)
    record = json.loads(files["result"].read_text()) if files["result"].is_file() else {}
    record = {**base, **record, "set": set_name, "wall_s": time.time() - start, "exit_code": code, "log": log.name}
    if code is None:
        record.setdefault("error", f"stopped at its {limit:.0f} s limit")
    elif code != 0:
        record.setdefault("error", f"exited with {code} before writing its result (see {log.name})")
    if code != 0:
        print("\n".join(log.read_text(errors="replace").splitlines()[-25:]), flush=True)
    print(f"=== {name}: exit {code} after {record['wall_s']:.0f} s", flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.deadline = time.time() + (args.budget if args.budget is not None else float("inf"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through run_limited, which ends the child
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO))
    from slice_model import slice_model_config, write_model_dirs

    config = slice_model_config(args.layers, tiny=args.tiny)
    dirs = write_model_dirs(out / "model", config)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {"records": []}
    results["slice"] = {
        "tiny": args.tiny,
        "layers": config.num_hidden_layers,
        "compress_ratios": list(config.compress_ratios),
        "num_hash_layers": config.num_hash_layers,
        "config_json": str(dirs["vllm"] / "config.json"),
    }
    results["definitions"] = {k: v.format(d=args.decode_tokens, w=STREAM_WARM_TOKENS) for k, v in DEFINITIONS.items()}
    mtps = [0, 1] if args.mtp == "both" else [int(args.mtp)]
    engines = ENGINES if args.only == "both" else (args.only,)
    for engine in engines:  # vLLM's children first, then dsinfer's: the same order in every run
        for mtp in mtps:
            for set_name, points in point_sets(args).items():
                record = run_child(engine, mtp, set_name, points, dirs[engine], args)
                merge_record(results, record)
                results_path.write_text(json.dumps(results, indent=1, default=str) + "\n")
    table = render_table(results)
    if args.profile:
        table += "\n\n" + render_profiles(results, args.profile_top)
    print(table, flush=True)
    (out / "table.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
