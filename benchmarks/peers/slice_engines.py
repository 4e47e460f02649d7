"""One engine, one process: build vLLM's or dsinfer's offline ``LLM`` on a model directory and time the points.

    python benchmarks/peers/slice_engines.py --engine vllm|dsinfer --model-dir DIR --points points.json \
        --result result.json [--mtp K] [--decode-tokens 128] [--device cuda] [--gpu-util 0.85] \
        [--profile-dir DIR [--profile-top 15]] [--deadline EPOCH_SECONDS]

``vllm_slice.py`` starts this once per engine, MTP setting and point set, each in a process of its own (its own
CUDA context; vLLM's engine starts its workers from it). The result file is rewritten after every point, so a
child stopped by its time limit still leaves the points it finished; a point that fails is recorded with its
reason and the rest go on. With ``--profile-dir`` each point is then profiled once more (``slice_profile.py``)
and its row gets the summary of where the time went.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import site
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slice_profile import PointProfiler  # noqa: E402
from slice_timing import (
    DECODE_TOKENS,
    Point,
    PromptMaker,
    engine_limits,
    graph_batches,
    measure_point,
    step_budget,
)  # noqa: E402
from slice_trace import DSINFER_STEP_ANNOTATION, DSINFER_STEP_PATTERN, VLLM_STEP_PATTERN  # noqa: E402

KV_CACHE_DTYPE = "fp8"  # vLLM 0.26 stores V4's cache as fp8_ds_mla and refuses "auto" for V4 on NVIDIA
BLOCK_SIZE = 256


def site_dirs_on_pythonpath() -> None:
    """Read the ``.pth`` files of PYTHONPATH entries as a site dir's are read (nvidia-cutlass-dsl puts ``cutlass``,
    the CuTe DSL of vLLM's V4 ops, on sys.path through one) and pass the result on to vLLM's processes."""
    added = []
    for entry in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        if glob.glob(os.path.join(entry, "*.pth")):
            before = set(sys.path)
            site.addsitedir(entry)
            added += [path for path in sys.path if path not in before]
    if added:
        os.environ["PYTHONPATH"] = os.pathsep.join([os.environ["PYTHONPATH"], *added])


def vllm_engine_args(
    model_dir: str, points: list[Point], mtp: int, gpu_util: float, decode_tokens: int, profile_dir: str | None = None
) -> dict:
    """Keywords for ``vllm.LLM``: the native V4 model on dummy weights, the release's fp8 cache layout, no prefix
    caching, the longest prompt in one step, CUDA graphs captured for exactly the measured decode batches (in
    tokens: a decode step of B requests with K drafts is B * (1 + K) tokens). ``profile_dir``: vLLM's torch
    profiler writes its traces there (its worker creates the profiler at the first ``start_profile``)."""
    limits = engine_limits(points, decode_tokens, mtp)
    profiler = vllm_profiler_config(profile_dir) if profile_dir else None
    return dict(
        model=model_dir,
        load_format="dummy",
        model_impl="vllm",
        kv_cache_dtype=KV_CACHE_DTYPE,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=False,
        enforce_eager=False,
        gpu_memory_utilization=gpu_util,
        seed=0,
        speculative_config={"method": "mtp", "num_speculative_tokens": mtp} if mtp else None,
        compilation_config={"cudagraph_capture_sizes": [b * (1 + mtp) for b in graph_batches(points)]},
        **({"profiler_config": profiler} if profiler else {}),
        **limits,
    )


def vllm_profiler_config(profile_dir: str) -> dict:
    """vLLM's torch profiler, as light as it goes: no Python stacks, no shapes, and no summary table printed at
    every stop (the trace is read here)."""
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(Path(profile_dir).resolve()),
        "torch_profiler_with_stack": False,
        "torch_profiler_dump_cuda_time_total": False,
        "torch_profiler_use_gzip": True,
        "ignore_frontend": True,
    }


def dsinfer_engine_options(points: list[Point], mtp: int, gpu_util: float, decode_tokens: int, device: str) -> dict:
    """Keywords for ``dsinfer.llm.LLM``, the same limits as vLLM's; CUDA graphs for the measured decode batches."""
    cuda = device.startswith("cuda")
    return dict(
        load_format="dummy",
        device=device,
        dtype="bfloat16" if cuda else "float32",
        enable_prefix_caching=False,
        enforce_eager=False,
        gpu_memory_utilization=gpu_util,
        cuda_graph_sizes=tuple(graph_batches(points)) if cuda else None,
        speculative_config={"method": "mtp", "num_speculative_tokens": mtp} if mtp else None,
        **engine_limits(points, decode_tokens, mtp),
    )


class OfflineEngine:
    """An engine's offline ``LLM`` behind the calls the timing makes; subclasses say how to build a request."""

    def __init__(self, llm, step_engine, sampling_params_class) -> None:
        self.llm, self.engine, self.params = llm, step_engine, sampling_params_class
        self.added = 0

    def sampling(self, new_tokens: int):
        """Greedy, exactly ``new_tokens`` tokens (end-of-sequence ignored), no text."""
        return self.params(
            max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True, temperature=0.0, detokenize=False
        )

    def prompt(self, ids: list[int]):
        return ids

    def generate(self, prompts: list[list[int]], new_tokens: int) -> float:
        inputs = [self.prompt(ids) for ids in prompts]
        start = time.perf_counter()
        outputs = self.llm.generate(inputs, self.sampling(new_tokens), use_tqdm=False)
        took = time.perf_counter() - start
        lengths = {len(o.outputs[0].token_ids) for o in outputs}
        if lengths != {new_tokens}:
            raise RuntimeError(f"asked for {new_tokens} tokens per request, got {sorted(lengths)}")
        return took

    def add(self, prompt: list[int], new_tokens: int) -> None:
        self.added += 1
        self._add(f"stream-{self.added}", self.prompt(prompt), self.sampling(new_tokens))

    def _add(self, request_id: str, prompt, params) -> None:
        raise NotImplementedError

    def step(self) -> list:
        return self.engine.step()

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()


def wait_for_new_file(directory: Path, before: set[Path], timeout: float = 60.0) -> Path:
    """The file that appeared in ``directory`` since ``before`` was listed, once its size holds still."""
    deadline, size = time.time() + timeout, -1
    while time.time() < deadline:
        new = sorted(set(directory.glob("*.json*")) - before, key=lambda path: path.stat().st_mtime)
        if new and new[-1].stat().st_size == size and size > 0:
            return new[-1]
        size = new[-1].stat().st_size if new else -1
        time.sleep(0.5)
    raise RuntimeError(f"no new trace in {directory} within {timeout:.0f} s of stop_profile")


class VllmEngine(OfflineEngine):
    """``vllm.LLM``; its step loop is ``llm.llm_engine``. Profiled by its worker (see :func:`vllm_profiler_config`)."""

    step_pattern = VLLM_STEP_PATTERN

    def __init__(self, engine_args: dict) -> None:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        patch_dummy_mhc_broadcast()
        llm = LLM(**engine_args)
        try:
            self.routing = llm.apply_model(spread_dummy_routing)[0]
        except Exception as exc:  # the comparison still runs; its record says the routing was left as drawn
            self.routing = f"routing left as vLLM's dummy weights drew it ({type(exc).__name__}: {exc})"
        super().__init__(llm, llm.llm_engine, SamplingParams)
        self.tokens_prompt = TokensPrompt
        profiler = engine_args.get("profiler_config") or {}
        self.profile_dir = Path(profiler["torch_profiler_dir"]) if profiler else None
        self.listed: set[Path] = set()
        self.label = ""

    def start_profile(self, label: str) -> None:
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        self.listed, self.label = set(self.profile_dir.glob("*.json*")), label
        self.llm.start_profile()

    def stop_profile(self) -> Path:
        """The worker writes the window's trace before ``stop_profile`` returns; it is renamed after the point."""
        self.llm.stop_profile()
        written = wait_for_new_file(self.profile_dir, self.listed)
        named = written.with_name(f"vllm-{self.label}.pt.trace.json" + (".gz" if written.suffix == ".gz" else ""))
        return written.rename(named)

    def prompt(self, ids: list[int]):
        return self.tokens_prompt(prompt_token_ids=ids)

    def _add(self, request_id: str, prompt, params) -> None:
        self.engine.add_request(request_id, prompt, params)

    def describe(self) -> str:
        """The model class vLLM built, how its routed experts run (read inside its worker), and its cache."""
        try:
            built = self.llm.apply_model(describe_vllm_model)[0]
        except Exception as exc:  # inspection is informative only
            built = f"(could not inspect the model: {type(exc).__name__}: {exc})"
        cache = getattr(getattr(self.engine, "vllm_config", None), "cache_config", None)
        blocks, size, dtype = (getattr(cache, name, "?") for name in ("num_gpu_blocks", "block_size", "cache_dtype"))
        return f"{built}; cache {blocks} blocks of {size} tokens ({dtype}); {self.routing}"


# vLLM 0.26.0's DeepSeek-V4 computes the first layer's mHC broadcast weights in ``load_weights``, which
# ``load_format="dummy"`` never calls: its first forward then fails on ``assert self.hc_attn_fn_broadcast is not
# None``. The fix computes them on first use, as ``finalize_mhc_broadcast_weights`` would have. It edits the
# installed file because vLLM's engine core runs in a process of its own, where a monkeypatch would not reach.
_MHC_ASSERT = "                assert self.hc_attn_fn_broadcast is not None\n"
_MHC_LAZY = (
    "                if self.hc_attn_fn_broadcast is None:  # dummy weights: load_weights never ran\n"
    "                    self.hc_attn_fn_broadcast = (\n"
    "                        self.hc_attn_fn.detach().view(-1, self.hc_mult, self.hidden_size).sum(dim=1)\n"
    "                    )\n"
)


def patch_dummy_mhc_broadcast() -> None:
    """Make vLLM's V4 model run with dummy weights (see above); says so when it edits the file."""
    import importlib.util

    spec = importlib.util.find_spec("vllm.models.deepseek_v4.nvidia.model")
    if spec is None or spec.origin is None:
        return
    path = Path(spec.origin)
    source = path.read_text()
    if source.count(_MHC_ASSERT) == 1:
        path.write_text(source.replace(_MHC_ASSERT, _MHC_LAZY))
        print(f"vllm: {path} computes the first layer's mHC broadcast on first use (dummy weights)", flush=True)


# vLLM's dummy weights are uniform in +-1e-3 with one seed a parameter, so every layer's selection bias
# (``e_score_correction_bias``) holds the same values, and they outweigh the router's logits (of the same tiny
# weights): every token then picks nearly the same experts, and a batch reads a few experts' weights where a real
# router (and dsinfer's dummy model) spreads it over many. Bounded by the HBM rate, vLLM's 8 Marlin launches of
# 32 tokens (1.08 ms) could read at most ~3.6 GB: ~67 experts a layer of the ~135 that 32 independent top-6 picks
# from 256 touch. The fix zeroes the bias and redraws each layer's router weights (normal, its own seed), in
# place, so the graphs captured at start-up route with them.
def spread_dummy_routing(model) -> str:
    """Runs inside vLLM's worker, right after start-up: routing of dummy weights spread as a trained router's
    (see above); says what it changed."""
    import torch

    layers = 0
    for index, module in enumerate(m for m in model.modules() if hasattr(m, "gate") and hasattr(m.gate, "weight")):
        gate = module.gate
        bias = getattr(gate, "e_score_correction_bias", None)
        if bias is None and getattr(gate, "tid2eid", None) is None:
            continue
        weight = gate.weight
        generator = torch.Generator(device=weight.device).manual_seed(1000 + index)
        drawn = torch.randn(weight.shape, generator=generator, device=weight.device, dtype=torch.float32)
        weight.data.copy_(drawn * weight.shape[-1] ** -0.5)
        if bias is not None:
            bias.data.zero_()
        layers += 1
    return f"router weights redrawn and selection bias zeroed in {layers} MoE layers"


def describe_vllm_model(model) -> str:
    """Runs inside vLLM's worker: the model class and its routed experts' method and backend."""
    experts = [m for m in model.modules() if type(getattr(m, "quant_method", None)).__name__.endswith("MoEMethod")]
    method = experts[0].quant_method if experts else None
    backend = getattr(method, "mxfp4_backend", None)
    backend = f" ({getattr(backend, 'name', backend)})" if backend is not None else ""
    return f"{type(model).__name__}: {len(experts)} routed-expert layers, {type(method).__name__}{backend}"


class DsinferEngine(OfflineEngine):
    """``dsinfer.llm.LLM``; its step loop is ``llm.engine``. Profiled by ``torch.profiler`` in this process (CUDA
    activity on a GPU: kernels replayed from CUDA graphs are recorded one by one), each ``step()`` annotated."""

    step_pattern = DSINFER_STEP_PATTERN

    def __init__(self, model_dir: str, options: dict, profile_dir: str | None = None) -> None:
        from dsinfer.llm import LLM
        from dsinfer.sampling_params import SamplingParams

        llm = LLM(model_dir, **options)
        super().__init__(llm, llm.engine, SamplingParams)
        self.profile_dir = Path(profile_dir) if profile_dir else None
        self.profiler, self.label = None, ""

    def step(self) -> list:
        if self.profiler is None:
            return self.engine.step()
        import torch

        with torch.profiler.record_function(DSINFER_STEP_ANNOTATION):
            return self.engine.step()

    def start_profile(self, label: str) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        self.profiler, self.label = torch.profiler.profile(activities=activities), label
        self.profiler.start()

    def stop_profile(self) -> Path:
        """Wait for the window's kernels, stop, and write the trace (gzipped Chrome JSON)."""
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        path = self.profile_dir / f"dsinfer-{self.label}.pt.trace.json.gz"
        profiler.export_chrome_trace(str(path))
        return path

    def _add(self, request_id: str, prompt, params) -> None:
        self.engine.add_request(prompt, params, request_id=request_id)

    def describe(self) -> str:
        model, runner = self.llm.model, self.engine.runner
        return (
            f"{type(model).__name__}, {model.config.num_hidden_layers} layers, dummy weights (FP4 experts "
            f"packed); cache {runner.num_blocks} blocks of {runner.block_tokens} tokens"
        )


def versions(engine: str) -> dict[str, str]:
    """The software that produced the numbers."""
    import torch

    found = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if engine == "vllm":
        import vllm

        found["vllm"] = vllm.__version__
    else:
        import dsinfer

        found["dsinfer"] = getattr(dsinfer, "__version__", "?")
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        pass
    return found


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else "cpu"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Time one engine on the slice's points (one child of vllm_slice.py)")
    parser.add_argument("--engine", choices=["vllm", "dsinfer"], required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--points", required=True, help="JSON file: a list of points")
    parser.add_argument("--result", required=True, help="JSON file to write (rewritten after every point)")
    parser.add_argument("--mtp", type=int, default=0, help="MTP drafts per step (0: off)")
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpu-util", type=float, default=0.85)
    parser.add_argument("--profile-dir", default=None, help="profile every point after timing; traces go here")
    parser.add_argument("--profile-top", type=int, default=15, help="kernels kept per profiled point")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="time.time() by which to be done")
    return parser.parse_args(argv)


def build_engine(args: argparse.Namespace, points: list[Point], record: dict[str, Any]):
    """The engine, with its exact configuration written into ``record`` first (so a failed build still says
    what was asked)."""
    if args.engine == "vllm":
        engine_args = vllm_engine_args(
            args.model_dir, points, args.mtp, args.gpu_util, args.decode_tokens, args.profile_dir
        )
        record["config"] = {
            "engine_args": engine_args,
            "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
        }
        return VllmEngine(engine_args)
    options = dsinfer_engine_options(points, args.mtp, args.gpu_util, args.decode_tokens, args.device)
    record["config"] = {"engine_options": options}
    return DsinferEngine(args.model_dir, options, args.profile_dir)


def time_points(args, engine, points: list[Point], record: dict[str, Any], save, profiler) -> None:
    """Time every point (a stream point's profile follows its timed window, in the same run); save after each."""
    prompts, budget = profiler.prompts, step_budget(points)
    for point in points:
        row: dict[str, Any] = {"unit": point.unit, "method": point.method if point.kind == "decode" else "prefill"}
        after_window = profiler.after_window(point, row) if args.profile_dir and point.method == "stream" else None
        started = time.time()
        try:
            row["value"] = measure_point(point, engine, prompts, args.decode_tokens, budget, after_window)
            print(f"{args.engine} (mtp {args.mtp}) {point.label}: {row['value']:.2f} {point.unit}", flush=True)
        except Exception as exc:  # out of memory, a missing kernel: this row says so, the others still run
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            print(f"{args.engine} (mtp {args.mtp}) {point.label}: FAILED {row['error']}", flush=True)
        row["measure_s"] = time.time() - started
        record["rows"][point.label] = row
        save()


def profile_points(args, points: list[Point], record: dict[str, Any], save, profiler: PointProfiler) -> None:
    """Profile every timed prefill and ``generate`` point once more, in order, while the child's time allows."""
    for point in points:
        row = record["rows"][point.label]
        if point.method == "stream" or row.get("value") is None:
            continue
        row["profile"] = profiler.profile(point, row)
        shown = row["profile"].get("skipped") or row["profile"].get("error") or "done"
        print(f"{args.engine} (mtp {args.mtp}) {point.label}: profile {shown}", flush=True)
        save()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.engine == "vllm":
        site_dirs_on_pythonpath()
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # lets apply_model() report the model
    points = [Point(**p) for p in json.loads(Path(args.points).read_text())]
    result = Path(args.result)
    record: dict[str, Any] = {
        "engine": args.engine,
        "mtp": args.mtp,
        "decode_tokens": args.decode_tokens,
        "rows": {},
        "started": time.time(),
    }

    def save() -> None:
        result.write_text(json.dumps(record, indent=1, default=str) + "\n")

    try:
        record["versions"] = versions(args.engine)
        record["gpu"] = device_name(args.device)
        engine = build_engine(args, points, record)
        record["model"] = engine.describe()
    except Exception as exc:  # the engine cannot run this slice: every row says why
        traceback.print_exc()
        record["error"] = f"{args.engine} could not build the slice: {type(exc).__name__}: {exc}"
        save()
        return 1
    record["startup_s"] = time.time() - record["started"]
    print(f"{args.engine} (mtp {args.mtp}): {record['model']}; up in {record['startup_s']:.0f} s", flush=True)
    save()
    prompts = PromptMaker(json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"])
    profiler = PointProfiler(engine, prompts, args.decode_tokens, args.profile_top, args.deadline)
    time_points(args, engine, points, record, save, profiler)
    if args.profile_dir:
        profile_points(args, points, record, save, profiler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
