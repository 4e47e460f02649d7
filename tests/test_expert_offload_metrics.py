"""The expert-offload counters reach ``dsinfer serve``'s /metrics (the engine in a process of its own, as
``serve`` runs it, or in the server's engine thread): reads, reads served from the GPU, experts fetched, bytes
copied host -> GPU, and the resident / offloaded expert gauges. A server whose experts all stay resident does not
export the families."""

from __future__ import annotations

import time
from dataclasses import replace

import httpx
import pytest
from server_harness import metric_value, running_server

from dsinfer.config import EngineConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY_EXPERT = 3 * 32 * 64 // 2 + 3 * 32 * 64 // 32  # one tiny routed expert: packed e2m1 codes + ue8m0 scales
LAYERS, EXPERTS, RESIDENT = 4, 8, 3
# 4 layers x 3 resident experts + 2 fetch buffers x 5 offloaded experts = 22 experts, and a little room to spare.
BUDGET_GIB = ((LAYERS * RESIDENT + 2 * (EXPERTS - RESIDENT)) * TINY_EXPERT + 1000) / 2**30
CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=512)
OFFLOAD = "dsinfer:expert_offload_"


def _complete(base: str, prompt: str) -> None:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200


def _offload_metrics(base: str) -> dict[str, float]:
    names = ("reads_total", "gpu_hits_total", "fetched_experts_total", "fetched_ahead_experts_total",
             "pcie_bytes_total", "resident_experts", "offloaded_experts")  # fmt: skip
    return {name: metric_value(base, OFFLOAD + name) for name in names}


def _settled(base: str, reads_above: float = 0.0) -> dict[str, float]:
    """The offload metrics once the engine process has reported the last step's counts (it does while idle)."""
    deadline, seen = time.monotonic() + 20, _offload_metrics(base)
    while time.monotonic() < deadline:
        time.sleep(1.2)
        again = _offload_metrics(base)
        if again == seen and again["reads_total"] > reads_above:
            return again
        seen = again
    raise AssertionError(f"the offload counters did not settle: {seen}")


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine-process", "engine-thread"])
def test_offload_counters_move_with_traffic(tiny_checkpoint, engine_process):
    config = replace(CONFIG, expert_offload=BUDGET_GIB)
    with running_server(tiny_checkpoint, config, engine_process=engine_process) as (base, _):
        _complete(base, "Hello world")
        first = _settled(base)
        assert first["resident_experts"] == LAYERS * RESIDENT
        assert first["offloaded_experts"] == LAYERS * (EXPERTS - RESIDENT)
        assert 0 < first["gpu_hits_total"] < first["reads_total"]  # some reads missed the resident experts
        assert first["fetched_experts_total"] > 0
        assert first["pcie_bytes_total"] == first["fetched_experts_total"] * TINY_EXPERT
        assert first["fetched_ahead_experts_total"] <= first["fetched_experts_total"]
        _complete(base, "The quick brown fox jumps over the lazy dog")
        second = _settled(base, reads_above=first["reads_total"])
        assert second["gpu_hits_total"] >= first["gpu_hits_total"]
        assert second["fetched_experts_total"] > first["fetched_experts_total"]
        assert second["resident_experts"] == first["resident_experts"]


def test_without_offload_the_families_are_absent(tiny_checkpoint):
    with running_server(tiny_checkpoint, CONFIG) as (base, _):
        _complete(base, "Hello world")
        text = httpx.get(f"{base}/metrics", timeout=5).text
        assert metric_value(base, "dsinfer:generation_tokens_total") > 0  # the step's other counters are there
        assert OFFLOAD not in text
