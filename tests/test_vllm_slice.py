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
