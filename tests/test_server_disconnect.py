"""A client that leaves aborts its request, streaming or not, whatever its n: every sequence (running or still
waiting) is gone before the engine's next step, and its cache blocks are free."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from server_harness import metric_value, running_server

from dsinfer.config import EngineConfig

CHAT = [{"role": "user", "content": "Tell me a long story."}]
# n = 8 over 4 batch slots: half the sequences run, half wait; neither may outlive the client.
LONG = {"model": "tiny", "messages": CHAT, "max_tokens": 1500, "ignore_eos": True, "n": 8, "temperature": 1.0}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=2048)
    with running_server(tiny_checkpoint, config) as (base, engine):
        yield base, engine


def wait_until_busy(base: str) -> None:
    deadline = time.monotonic() + 30
    while metric_value(base, "dsinfer:num_requests_running") < 4:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.02)
    assert metric_value(base, "dsinfer:num_requests_waiting") == 4


def assert_aborted(base: str, engine) -> None:
    """Within a short time nothing runs, waits or holds cache, and no further tokens are made."""
    deadline = time.monotonic() + 5
    gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_in_use")
    while any(metric_value(base, f"dsinfer:{g}") for g in gauges):
        assert time.monotonic() < deadline, {g: metric_value(base, f"dsinfer:{g}") for g in gauges}
        time.sleep(0.02)
    assert engine.engine.requests == {}
    generated = metric_value(base, "dsinfer:generation_tokens_total")
    time.sleep(0.3)
    assert metric_value(base, "dsinfer:generation_tokens_total") == generated
    assert generated < 8 * 1500 / 4  # stopped long before the end


def aborts(base: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dsinfer:request_success_total{") and 'finished_reason="abort"' in line)  # fmt: skip


def test_non_streaming_request_is_aborted_when_the_client_leaves(server):
    base, engine = server
    before = metric_value(base, "dsinfer:generation_tokens_total")
    aborted_before = aborts(base)
    errors = []

    def send():
        try:
            httpx.post(f"{base}/v1/chat/completions", json=LONG, timeout=httpx.Timeout(60, read=1.5))
        except httpx.ReadTimeout as exc:  # the client gives up and closes the connection
            errors.append(exc)

    thread = threading.Thread(target=send)
    thread.start()
    wait_until_busy(base)
    thread.join()
    assert errors, "the request finished before the client left; make it longer"
    assert_aborted(base, engine)
    assert metric_value(base, "dsinfer:generation_tokens_total") > before  # it really had been running
    assert aborts(base) == aborted_before + 8  # each completion: request_success_total{finished_reason="abort"}


def test_streaming_request_is_aborted_when_the_client_leaves(server):
    base, engine = server
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**LONG, "stream": True}, timeout=60) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {") and any(c["delta"].get("content") for c in json.loads(line[6:])["choices"]):
                break  # the first generated text: the request is running
        wait_until_busy(base)
    assert_aborted(base, engine)


def test_batched_completion_is_aborted_when_the_client_leaves(server):
    base, engine = server
    body = {"model": "tiny", "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    assert_aborted(base, engine)


def test_the_server_serves_normally_after_aborts(server):
    base, _ = server
    out = httpx.post(f"{base}/v1/chat/completions", json={**LONG, "max_tokens": 3}, timeout=60).json()
    assert len(out["choices"]) == 8 and out["usage"]["completion_tokens"] == 24
