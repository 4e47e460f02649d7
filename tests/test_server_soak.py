"""A bounded soak: 200 requests at concurrency 16, mixing valid requests (chat and text, streaming or not,
n up to 2), client aborts (streams dropped midway, non-streaming requests given up on) and malformed bodies.

Nothing may answer 5xx; every malformed body gets an OpenAI-style 4xx; afterwards nothing runs, waits or holds
cache blocks (read from /metrics), and the process's resident memory has not grown beyond a bound."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import metric_value, running_server

from dsinfer.config import EngineConfig

CHAT = [{"role": "user", "content": "Hello there"}]
MALFORMED = [
    (b'{"model": "tiny", "messages": [', "application/json"),
    (b"", "application/json"),
    (b"[1, 2, 3]", "application/json"),
    (b"messages=hi", "text/plain"),
    ({"messages": "hi"}, None),
    ({"messages": CHAT, "temperature": "hot"}, None),
    ({"messages": CHAT, "n": 10**9}, None),
    ({"messages": CHAT, "max_tokens": 10**6}, None),
    ({"messages": CHAT, "model": "gpt-9"}, None),
    ({"messages": CHAT, "top_logprobs": 3}, None),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, None),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, None),
    ({"messages": CHAT, "response_format": {"type": "json_schema"}}, None),
    ({"messages": CHAT, "stream": "yes"}, None),
    ({"prompt": [[-1]]}, "completions"),
    ({"prompt": [[1, 2], []]}, "completions"),
    ({"prompt": "x", "max_tokens": 0}, "completions"),
]
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_in_use")


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=512)
    with running_server(tiny_checkpoint, config) as (base, engine):
        yield base, engine


def valid(http: httpx.Client, base: str, rng: random.Random) -> list[int]:
    n = rng.choice([1, 1, 2])
    if rng.random() < 0.5:
        route, body = "chat/completions", {"messages": CHAT}
    else:
        route, body = "completions", {"prompt": rng.choice(["Hi", ["a", "b"], [[5, 6, 7]]])}
    body |= {"model": "tiny", "max_tokens": rng.randint(1, 8), "n": n, "temperature": rng.choice([0, 1])}
    if rng.random() < 0.5:
        with http.stream("POST", f"{base}/v1/{route}", json={**body, "stream": True}) as response:
            lines = list(response.iter_lines())
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]", lines[-3:]
        assert not any('"error"' in line for line in lines), lines
        return [response.status_code]
    response = http.post(f"{base}/v1/{route}", json=body)
    assert response.status_code == 200 and response.json()["choices"], response.text
    return [response.status_code]


def abort(http: httpx.Client, base: str, rng: random.Random) -> list[int]:
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 300, "ignore_eos": True, "n": rng.choice([1, 2])}
    if rng.random() < 0.5:
        with http.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}) as response:
            for count, _line in enumerate(response.iter_lines()):
                if count >= 3:
                    break  # the client goes away mid-stream
        return [response.status_code]
    try:
        response = http.post(f"{base}/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
        return [response.status_code]  # finished before the client gave up
    except httpx.ReadTimeout:
        return []


def malformed(http: httpx.Client, base: str, index: int) -> list[int]:
    body, kind = MALFORMED[index % len(MALFORMED)]
    route = "completions" if kind == "completions" else "chat/completions"
    if isinstance(body, bytes):
        response = http.post(f"{base}/v1/{route}", content=body, headers={"content-type": kind})
    else:
        response = http.post(f"{base}/v1/{route}", json={"model": "tiny", **body})
    assert 400 <= response.status_code < 500, (body, response.status_code, response.text)
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and error["type"], (body, error)
    return [response.status_code]


def soak(base: str, count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    plan = ["valid"] * 70 + ["abort"] * 20 + ["malformed"] * 10
    jobs = [(rng.choice(plan), random.Random(seed * 1000 + i), i) for i in range(count)]

    def run(job) -> list[int]:
        kind, job_rng, index = job
        with httpx.Client(timeout=60) as http:
            if kind == "valid":
                return valid(http, base, job_rng)
            if kind == "abort":
                return abort(http, base, job_rng)
            return malformed(http, base, index)

    with ThreadPoolExecutor(max_workers=16) as pool:
        return [status for statuses in pool.map(run, jobs) for status in statuses]


def wait_idle(base: str) -> dict[str, float]:
    deadline = time.monotonic() + 20
    while True:
        values = {g: metric_value(base, f"dsinfer:{g}") for g in GAUGES}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def test_soak_no_5xx_everything_freed_memory_bounded(server):
    base, engine = server
    soak(base, 40, seed=1)  # warm-up: allocator pools, grammar and tokenizer caches
    assert not any(wait_idle(base).values())
    before = rss_bytes()
    statuses = soak(base, 200, seed=2)
    assert statuses and all(status < 500 for status in statuses), sorted(set(statuses))
    assert wait_idle(base) == dict.fromkeys(GAUGES, 0.0)
    assert engine.engine.requests == {} and engine.alive
    growth = rss_bytes() - before
    assert growth < 64 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB over 200 requests"
    ok = httpx.post(f"{base}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200
