"""``benchmarks/expert_offload.py --tiny``: both parts run on the CPU and report traffic that offloading explains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_offload_benchmark_runs_on_the_cpu_with_tiny_shapes(tmp_path):
    out = tmp_path / "offload.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / "expert_offload.py"), "--tiny", "--out", str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    per_layer = report["per_layer"]
    assert per_layer["all_resident"]["gpu_served_fraction"] == 1.0
    assert per_layer["all_resident"]["pcie_bytes_per_processed_token"] == 0.0
    offloaded = per_layer["offloaded_skewed"]
    assert 0 < offloaded["gpu_served_fraction"] < 1 and offloaded["pcie_bytes_per_processed_token"] > 0
    assert per_layer["decode_ratio"] > 0 and per_layer["prefill_ratio"] > 0
    full = report["full_depth"]
    for key in ("uniform_1_streams", "uniform_8_streams", "skewed_1_streams", "skewed_8_streams"):
        assert full[key]["tpot_s"] > 0 and full[key]["ttft_s"] > 0
        assert 0 < full[key]["gpu_served_fraction"] < 1
