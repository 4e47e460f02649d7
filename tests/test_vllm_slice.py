"""``benchmarks/peers/vllm_slice.py``: the config both engines read is dsinfer's ``--flash-layers`` slice, the two
timing methods count what they say, the ratio points the right way, and a tiny dsinfer run on the CPU fills the
dsinfer column beside a vLLM column measured earlier (the two-call workflow)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dsinfer.bench.shapes import flash_slice_config
from dsinfer.config import ModelConfig

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))

import slice_engines  # noqa: E402
import slice_table  # noqa: E402
import slice_timing  # noqa: E402
import slice_trace  # noqa: E402
from slice_model import release_config_dict, slice_model_config  # noqa: E402


@pytest.mark.parametrize("layers", [4, 7])
def test_config_json_reads_back_as_the_flash_slice(layers):
    data = json.loads(json.dumps(release_config_dict(slice_model_config(layers))))
    assert data["architectures"] == ["DeepseekV4ForCausalLM"]
    assert data["quantization_config"]["weight_block_size"] == [128, 128]
    assert data["compress_ratios"] == [(0, 4, 128)[i % 3] for i in range(layers)] + [0]
    assert "compress_rate_hca" not in data  # the release spells the rates per layer only
    back = ModelConfig.from_dict(data)
    assert replace(back, quantization=None) == replace(flash_slice_config(layers), num_nextn_predict_layers=1)
    assert back.quantization.expert_dtype == "fp4"


def test_engine_settings_match_and_capture_the_measured_batches():
    points = slice_timing.default_points([4096, 16384], [1, 32, 256], [256, 4096])
    vllm = slice_engines.vllm_engine_args("/m", points, mtp=1, gpu_util=0.85, decode_tokens=128)
    dsinfer = slice_engines.dsinfer_engine_options(points, mtp=1, gpu_util=0.85, decode_tokens=128, device="cuda")
    assert vllm["compilation_config"]["cudagraph_capture_sizes"] == [2, 64, 512]  # tokens: B * (1 + K)
    assert dsinfer["cuda_graph_sizes"] == (1, 32, 256)  # requests
    for key in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization"):
        assert vllm[key] == dsinfer[key], key
    assert vllm["max_num_batched_tokens"] == 16384 and vllm["max_num_seqs"] == 256
    assert vllm["max_model_len"] >= 4096 + 1 + 128 + 1
    assert not vllm["enable_prefix_caching"] and not dsinfer["enable_prefix_caching"]


class FakeEngine:
    """A step gives each running request one token and takes a fake second times the share of requests still
    running. ``staggered``: the n-th request's prefill (its first token) comes in step n, as a long prompt's
    chunks spread a batch's prefills over many steps."""

    def __init__(self, clock, staggered=False):
        self.clock, self.requests, self.staggered, self.steps = clock, {}, staggered, 0

    def add(self, prompt, new_tokens):
        self.requests[f"r{len(self.requests)}"] = [0, new_tokens]

    def busy(self):
        return any(have < want for have, want in self.requests.values())

    def step(self):
        running = [(rid, held) for rid, held in self.requests.items() if held[0] < held[1]]
        self.clock[0] += len(running) / len(self.requests)
        self.steps += 1
        outputs = []
        for index, (request_id, held) in enumerate(running):
            if held[0] == 0 and self.staggered and index >= self.steps:
                continue  # not prefilled yet
            held[0] += 1
            outputs.append(Output(request_id, held[0]))
        return outputs

    def generate(self, prompts, new_tokens):
        start = self.clock[0]
        for ids in prompts:
            self.add(ids, new_tokens)
        while self.busy():
            self.step()
        self.requests.clear()
        return self.clock[0] - start + 0.25  # a fixed overhead that the generate method must cancel


class Output:
    def __init__(self, request_id, tokens):
        self.request_id, self.outputs = request_id, [type("Completion", (), {"token_ids": [7] * tokens})()]


def test_both_decode_methods_time_full_batch_steps(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(slice_timing.time, "perf_counter", lambda: clock[0])
    prompts = slice_timing.PromptMaker(100)
    generate = slice_timing.Point("decode", batch=3, context=8)
    # a full-batch step is one fake second: both methods give 1000 ms/step, whatever the fixed overhead
    measured = slice_timing.measure_point(generate, FakeEngine(clock), prompts, decode_tokens=5, budget=16384)
    assert measured == pytest.approx(1000.0)
    # staggered prefills: the requests prefilled first must not finish (and cheapen the steps) inside the window
    stream = slice_timing.Point("decode", batch=6, context=8192, method="stream")
    staggered = FakeEngine(clock, staggered=True)
    assert slice_timing.measure_point(stream, staggered, prompts, decode_tokens=5, budget=8192) == pytest.approx(1e3)
    assert not staggered.busy()  # the rest was run out
    prefill = slice_timing.Point("prefill", tokens=64)
    measured = slice_timing.measure_point(prefill, FakeEngine(clock), prompts, decode_tokens=5, budget=16384)
    assert measured == pytest.approx(64 / 1.25)


def test_ratio_is_dsinfer_speed_over_vllm_speed():
    assert slice_table.ratio("tokens/s", 50_000.0, 100_000.0) == pytest.approx(2.0)
    assert slice_table.ratio("ms/step", 6.0, 3.0) == pytest.approx(2.0)


def test_tiny_dsinfer_run_fills_its_column_beside_an_earlier_vllm_one(tmp_path):
    earlier = {
        "engine": "vllm",
        "mtp": 0,
        "set": "main",
        "labels": ["prefill 32", "decode 1 @ 16"],
        "units": ["tokens/s", "ms/step"],
        "rows": {"prefill 32": {"value": 10.0, "unit": "tokens/s"}},
        "error": "stopped at its 540 s limit",
    }
    (tmp_path / "results.json").write_text(json.dumps({"records": [earlier]}))
    command = [
        sys.executable,
        str(PEERS / "vllm_slice.py"),
        "--tiny",
        "--only",
        "dsinfer",
        "--mtp",
        "0",
        "--out",
        str(tmp_path),
    ]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {row["point"]: row for row in slice_table.table_rows(results)}
    assert set(rows) == {"prefill 32", "prefill 64", "decode 1 @ 16", "decode 2 @ 16"}
    assert all(row["dsinfer"] > 0 for row in rows.values())
    assert rows["prefill 32"]["ratio"] == pytest.approx(rows["prefill 32"]["dsinfer"] / 10.0)
    assert rows["decode 1 @ 16"]["vllm"] is None and "540 s" in rows["decode 1 @ 16"]["vllm_why"]
    table = (tmp_path / "table.md").read_text()
    assert "| 0 | decode 2 @ 16 | ms/step | - (stopped at its 540 s limit) |" in table
    config = json.loads((tmp_path / "model" / "dsinfer" / "config.json").read_text())
    assert config == json.loads((tmp_path / "model" / "vllm" / "config.json").read_text())


def test_a_spent_budget_starts_no_child_and_still_prints_the_table(tmp_path):
    command = [sys.executable, str(PEERS / "vllm_slice.py"), "--tiny", "--budget", "0", "--out", str(tmp_path)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "| 1 | decode 2 @ 16 | ms/step | - (not started: the run's --budget was spent) |" in finished.stdout
    assert not list(tmp_path.glob("*.log"))  # no child ran


def test_vllm_dummy_weights_fix_computes_the_mhc_broadcast_on_first_use(tmp_path, monkeypatch):
    """The installed vLLM's first-layer assert becomes a lazy computation, once; the patched code runs."""
    package = tmp_path / "vllm" / "models" / "deepseek_v4" / "nvidia"
    package.mkdir(parents=True)
    for folder in (tmp_path / "vllm", *list(package.parents)[:3], package):
        (folder / "__init__.py").touch()
    (package / "model.py").write_text(
        "class Layer:\n"
        "    def forward(self):\n"
        "        if True:\n"
        "            if True:\n" + slice_engines._MHC_ASSERT + "        return self.hc_attn_fn_broadcast\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    slice_engines.patch_dummy_mhc_broadcast()
    slice_engines.patch_dummy_mhc_broadcast()  # a second call leaves the patched file alone
    patched = (package / "model.py").read_text()
    assert slice_engines._MHC_ASSERT not in patched and patched.count("dummy weights") == 1
    namespace: dict = {}
    exec(patched, namespace)
    layer = namespace["Layer"]()
    layer.hc_attn_fn_broadcast, layer.hc_mult, layer.hidden_size = None, 2, 3
    import torch

    layer.hc_attn_fn = torch.arange(12.0).view(2, 6)
    assert torch.equal(layer.forward(), torch.arange(12.0).view(-1, 2, 3).sum(dim=1))


def _event(name, cat, ts, dur, tid=7, **extra):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, **extra}


def _write_trace(path, events):
    import gzip

    with gzip.open(path, "wt") as handle:
        json.dump({"schemaVersion": 1, "traceEvents": events}, handle)


def test_trace_summary_counts_steps_kernels_and_busy_time_of_a_gpu_trace(tmp_path):
    """Two vLLM steps of 100 us each: kernels on two streams (an overlap counted once), a copy, a gap the host
    left; an empty step, the GPU copies of the annotations and runtime calls are not steps or device time."""
    events = [
        _event("execute_context_0(0)_generation_2(2)", "user_annotation", 0, 90),
        _event("execute_context_0(0)_generation_2(2)", "user_annotation", 100, 90),
        _event("execute_context_0(0)_generation_0(0)", "user_annotation", 195, 2),
        _event("execute_context_0(0)_generation_2(2)", "gpu_user_annotation", 0, 200, tid=9),
        _event("cudaGraphLaunch", "cuda_runtime", 1, 5, args={"correlation": 11}),
        _event("cudaGraphLaunch", "cuda_runtime", 101, 5, args={"correlation": 12}),
        _event("cpu work", "cpu_op", 0, 200),
    ]
    for base in (0, 100):  # per step: gemm 40 us, attention 20 us beside it on a second stream, a copy of 10 us
        events += [
            _event("void deep_gemm::fp8_gemm<128, 64>(float*, int)", "kernel", base + 10, 40, tid=9),
            _event("flash_attn_fwd", "kernel", base + 30, 20, tid=10, args={"correlation": 11 + base // 100}),
            _event("Memcpy DtoD", "gpu_memcpy", base + 60, 10, tid=9),
        ]
    events.append(_event("tail", "kernel", 190, 20, tid=9))  # the window ends with it: 10..210 us
    path = tmp_path / "vllm.pt.trace.json.gz"
    _write_trace(path, events)
    summary = slice_trace.summarize_trace(slice_trace.load_trace_events(path), slice_trace.VLLM_STEP_PATTERN, top=2)
    assert summary["source"] == "gpu kernels" and summary["steps"] == 2 and summary["graph_launches"] == 2
    assert summary["graph_kernels"] == 2 and "note" not in summary
    assert summary["window_ms"] == pytest.approx(0.2) and summary["step_ms"] == pytest.approx(0.1)
    assert summary["busy_ms_per_step"] == pytest.approx((2 * (40 + 10) + 20) / 2 / 1e3)  # the overlap once
    assert summary["busy_share"] == pytest.approx(120 / 200)
    gemm, attention = summary["top"]
    assert gemm["name"].startswith("void deep_gemm") and gemm["calls"] == 2 and gemm["calls_per_step"] == 1
    assert gemm["ms_per_step"] == pytest.approx(0.04) and gemm["share"] == pytest.approx(0.4)
    assert attention["name"] == "flash_attn_fwd" and attention["ms_per_step"] == pytest.approx(0.02)
    assert summary["rest_ms_per_step"] == pytest.approx((20 + 20) / 2 / 1e3)  # the copies and the tail
    assert slice_trace.short_kernel_name(gemm["name"]) == "deep_gemm::fp8_gemm<128, 64>"


def test_trace_summary_of_cpu_operators_uses_self_time_and_says_what_graphs_hid(tmp_path):
    nested = [
        _event("dsinfer_step", "user_annotation", 0, 100),
        _event("aten::linear", "cpu_op", 0, 50),
        _event("aten::addmm", "cpu_op", 5, 40),
        _event("aten::add", "cpu_op", 60, 10),
        _event("aten::add", "cpu_op", 70, 10, tid=8),  # another thread: not nested in anything
    ]
    summary = slice_trace.summarize_trace(nested, slice_trace.DSINFER_STEP_PATTERN, top=5)
    assert summary["source"].startswith("cpu ops") and summary["steps"] == 1
    times = {kernel["name"]: kernel["ms_per_step"] for kernel in summary["top"]}
    assert times == pytest.approx({"aten::addmm": 0.04, "aten::add": 0.02, "aten::linear": 0.01})
    graphs_only = [_event("dsinfer_step", "user_annotation", 0, 100), _event("cudaGraphLaunch", "cuda_runtime", 1, 3)]
    hidden = slice_trace.summarize_trace(graphs_only, slice_trace.DSINFER_STEP_PATTERN)
    assert hidden["top"] == [] and "1 CUDA graph launches" in hidden["note"]
    outside_graphs = [*graphs_only, _event("sampler", "kernel", 50, 5, args={"correlation": 3})]
    partial = slice_trace.summarize_trace(outside_graphs, slice_trace.DSINFER_STEP_PATTERN)
    assert partial["graph_kernels"] == 0 and "inside 1 CUDA graph launches were not recorded" in partial["note"]


class ProfiledFakeEngine(FakeEngine):
    """The fake engine with a profiler: each step inside a window leaves an annotation and one kernel of a
    fake millisecond per running request in the trace it writes."""

    step_pattern = "^fake_step$"

    def __init__(self, clock, trace_dir):
        super().__init__(clock)
        self.trace_dir, self.events, self.label = trace_dir, None, ""

    def step(self):
        running = sum(held[0] < held[1] for held in self.requests.values())
        if self.events is not None:
            now = 1e6 * self.clock[0]
            self.events += [
                _event("fake_step", "user_annotation", now, 10),
                _event("decode_kernel", "kernel", now, 1e3 * running, tid=9),
            ]
        return super().step()

    def start_profile(self, label):
        self.events, self.label = [], label

    def stop_profile(self):
        path = self.trace_dir / f"{self.label}.json.gz"
        _write_trace(path, self.events)
        self.events = None
        return path


def test_profiles_follow_timing_cover_full_batch_steps_and_respect_the_deadline(tmp_path, monkeypatch):
    import slice_profile

    clock = [0.0]
    monkeypatch.setattr(slice_timing.time, "perf_counter", lambda: clock[0])
    engine, prompts = ProfiledFakeEngine(clock, tmp_path), slice_timing.PromptMaker(100)
    profiler = slice_profile.PointProfiler(engine, prompts, decode_tokens=128, top=3, deadline=float("inf"))
    decode = slice_timing.Point("decode", batch=4, context=8)
    summary = profiler.profile(decode, {"measure_s": 1.0})
    assert summary["steps"] == 32 and summary["trace"] == "decode-4-at-8.json.gz"
    assert summary["top"][0]["calls_per_step"] == 1 and summary["top"][0]["ms_per_step"] == pytest.approx(4.0)
    assert not engine.busy()  # the requests were run out
    prefill = profiler.profile(slice_timing.Point("prefill", tokens=64), {"measure_s": 1.0})
    assert prefill["steps"] == 1 and prefill["top"][0]["ms_per_step"] == pytest.approx(1.0)
    stream = slice_timing.Point("decode", batch=3, context=8, method="stream", profile_room=96)
    row: dict = {}
    slice_timing.measure_point(stream, engine, prompts, 5, 16384, profiler.after_window(stream, row))
    assert row["profile"]["steps"] == 32 and row["profile"]["top"][0]["ms_per_step"] == pytest.approx(3.0)
    late = slice_profile.PointProfiler(engine, prompts, 128, 3, deadline=slice_profile.time.time() + 20)
    first = late.profile(decode, {"measure_s": 60.0})
    assert "skipped" in first and "a profile needs about 45 s" in first["skipped"]
    assert late.profile(decode, {"measure_s": 0.0}) == first  # once short of time, every later one is skipped
    assert not list(tmp_path.glob("decode-4-at-8*.json.gz"))[1:]  # the skipped ones wrote no trace


def test_tiny_dsinfer_run_with_profile_records_and_prints_each_rows_top_operators(tmp_path):
    """A real torch.profiler run of dsinfer's tiny model on the CPU, where CPU operators stand in for kernels."""
    command = [sys.executable, str(PEERS / "vllm_slice.py"), "--tiny", "--only", "dsinfer", "--mtp", "0", "--long",
               "--profile", "--profile-top", "4", "--out", str(tmp_path)]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    profiles = {label: row["profile"] for record in results["records"] for label, row in record["rows"].items()}
    assert set(profiles) == {"prefill 32", "prefill 64", "decode 1 @ 16", "decode 2 @ 16", "decode 1 @ 48",
                             "decode 2 @ 48"}  # fmt: skip
    for label, profile in profiles.items():
        assert profile["source"].startswith("cpu ops"), label
        assert len(profile["top"]) == 4 and all(k["name"].startswith("aten::") for k in profile["top"]), label
        assert 0 < sum(k["share"] for k in profile["top"]) < 1 and 0 < profile["busy_share"] <= 1, label
        trace = tmp_path / "profiles" / f"dsinfer-mtp0-{'long' if '48' in label else 'main'}" / profile["trace"]
        assert trace.is_file(), label
    assert profiles["decode 2 @ 48"]["steps"] == 32  # the stream point's window: P steps after the timed one
    assert profiles["decode 2 @ 16"]["steps"] == 1 and profiles["prefill 64"]["steps"] == 1  # --decode-tokens 4
    table = (tmp_path / "table.md").read_text()
    assert "top kernels per step" in table and "### MTP 0, decode 2 @ 48" in table
    assert "- vLLM: not profiled" in table and "| 1 |  | | |  | aten::" in table


def test_vllm_dummy_routing_is_spread_over_the_experts():
    """vLLM's dummy MoE layers (one shared selection bias that outweighs the logits) route a batch to a few experts;
    after the fix the bias is zero and each layer's router its own normal draw, so 32 tokens of random hidden states
    touch most of the experts 32 independent top-6 picks would; a module without a router is left alone."""
    import torch
    from torch import nn

    hidden, experts = 64, 256

    def moe(hashed: bool) -> nn.Module:
        module = nn.Module()
        module.gate = nn.Linear(hidden, experts, bias=False)
        module.gate.weight.data.uniform_(-1e-3, 1e-3)
        module.gate.e_score_correction_bias = None if hashed else nn.Parameter(torch.linspace(1e-3, -1e-3, experts))
        table = nn.Parameter(torch.zeros(10, 6, dtype=torch.int32), requires_grad=False)
        module.gate.tid2eid = table if hashed else None
        return module

    model = nn.Sequential(moe(True), moe(False), moe(False), nn.Linear(4, 4))
    plain = model[3].weight.detach().clone()
    tokens = torch.randn(32, hidden) * 1e-3

    def touched(module: nn.Module) -> int:
        scores = nn.functional.softplus(module.gate(tokens)).sqrt() + module.gate.e_score_correction_bias
        return scores.topk(6, dim=-1).indices.unique().numel()

    assert touched(model[1]) == 6  # the bias alone picks: every token the same experts
    said = slice_engines.spread_dummy_routing(model)
    assert said == "router weights redrawn and selection bias zeroed in 3 MoE layers"
    assert torch.equal(model[3].weight, plain)
    assert not model[1].gate.e_score_correction_bias.any()
    assert not torch.equal(model[1].gate.weight, model[2].gate.weight)
    assert touched(model[1]) > 100 and touched(model[2]) > 100  # of ~135 for independent uniform picks
