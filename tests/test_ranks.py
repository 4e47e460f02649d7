"""One process per rank on the CPU (gloo): DP attention ranks with EP-sharded experts give one rank's tokens,
through ``LLM`` and through the server; a rank that dies takes the server down cleanly; SIGTERM drains.

Kept small for two cores: tiny models, few tokens; the 4-rank layout runs only the key equality test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
from engine_harness import random_prompts
from server_harness import free_port, running_server

from dsinfer.config import EngineConfig
from dsinfer.llm import LLM
from dsinfer.parallel.config import ParallelConfig
from dsinfer.parallel.ranked_engine import RankDiedError
from dsinfer.sampling_params import SamplingParams

MIXED = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
         SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=8, ignore_eos=True)]  # fmt: skip
# A small cache per rank and a small step budget: long prompts are chunked and sequences get preempted.
SMALL = {"num_cache_blocks": 6, "max_num_batched_tokens": 48, "max_model_len": 128}


def _tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def _mixed_batch(count: int, seed: int, high: int = 90):
    prompts = random_prompts(count, seed=seed, high=high)
    return prompts, [MIXED[i % 2] for i in range(count)]


@pytest.fixture(scope="module")
def v4_reference(tiny_checkpoint):
    prompts, params = _mixed_batch(8, seed=1)
    with LLM(tiny_checkpoint, **SMALL) as one:
        outputs = one.generate(prompts, params, use_tqdm=False)
        assert one.engine.scheduler.num_preemptions > 0
    return prompts, params, _tokens(outputs)


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_give_one_ranks_greedy_and_seeded_tokens(tiny_checkpoint, v4_reference, ranks):
    prompts, params, expected = v4_reference
    with LLM(tiny_checkpoint, data_parallel_size=ranks, expert_parallel_size=ranks, **SMALL) as llm:
        assert llm.model is None  # the weights live in the ranks
        got = _tokens(llm.generate(prompts, params, use_tqdm=False))
        if ranks == 2:  # four sequences per rank outgrow its six blocks (with four ranks, two fit)
            assert llm.engine.load().preemptions > 0
        assert llm.engine.load().blocks_used == 0
    assert got == expected


def _completions(outputs) -> list[list[tuple]]:
    return [[(c.token_ids, c.text, c.finish_reason) for c in out.outputs] for out in outputs]


def test_stop_strings_applied_in_the_api_process_end_completions_as_one_rank_does(tiny_checkpoint):
    prompts = random_prompts(3, seed=11, high=30)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)
    with LLM(tiny_checkpoint, max_model_len=128) as one:
        plain = one.generate(prompts, [greedy, greedy, sampled], use_tqdm=False)
        texts = [out.outputs[0].text for out in plain]
        assert all(len(text) >= 6 for text in texts)
        params = [
            replace(greedy, stop=[texts[0][3:5]]),
            replace(greedy, stop=[texts[1][2:4], "never"], include_stop_str_in_output=True),
            replace(sampled, stop=[texts[2][2:5]]),
        ]
        expected = one.generate(prompts, params, use_tqdm=False)
    # Every first completion meets its stop string; the second sample of the last request does not and
    # runs on after its sibling ended (the rank is told to finish one sequence of two).
    assert [[c.finish_reason for c in out.outputs] for out in expected] == [["stop"], ["stop"], ["stop", "length"]]
    with LLM(tiny_checkpoint, max_model_len=128, data_parallel_size=2, expert_parallel_size=2) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    assert _completions(got) == _completions(expected)


def test_v41_ranks_with_redundant_experts_and_sharded_engram_give_one_ranks_tokens(tiny_v41_checkpoint, tmp_path):
    prompts, params = _mixed_batch(4, seed=3, high=40)
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"ranks": [[0, 1, 2, 3, 4, 5], [2, 3, 4, 5, 6, 7]]}))
    small = {"max_num_batched_tokens": 32, "max_model_len": 128}
    with LLM(tiny_v41_checkpoint, **small) as one:
        expected = _tokens(one.generate(prompts, params, use_tqdm=False))
    options = {"data_parallel_size": 2, "expert_parallel_size": 2, "expert_placement": str(placement),
               "engram_placement": "sharded"}  # fmt: skip
    with LLM(tiny_v41_checkpoint, **options, **small) as llm:
        got = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert got == expected


def test_server_on_two_ranks_answers_like_one_rank(tiny_checkpoint):
    prompts = random_prompts(4, seed=5, high=40)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)
    with LLM(tiny_checkpoint, config) as one:
        expected = [out.outputs[0].text for out in one.generate(prompts, params, use_tqdm=False)]
    with running_server(tiny_checkpoint, config, parallel=ParallelConfig(2, 2)) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        results: dict[int, str] = {}

        def ask(i: int) -> None:
            reply = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True})  # fmt: skip
            results[i] = reply.choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=6, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert [results.get(i) for i in range(len(prompts))] == expected
    assert streamed == expected[0]


def test_a_rank_that_fails_to_load_stops_the_start_naming_it(tiny_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    shard = sorted(broken.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # the ranks find it truncated
    before = set(_descendants(os.getpid()))
    with pytest.raises(RankDiedError, match=r"rank \d failed while starting: CheckpointError"):
        LLM(broken, data_parallel_size=2, expert_parallel_size=2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and [p for p in set(_descendants(os.getpid())) - before if _is_rank(p)]:
        time.sleep(0.1)
    assert not [p for p in set(_descendants(os.getpid())) - before if _is_rank(p)]


# ---- processes -----------------------------------------------------------------------------------


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            tree.setdefault(parent, []).append(int(entry))
    return tree


def _descendants(pid: int) -> list[int]:
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _rank_pids(pid: int) -> list[int]:
    """Ranks fork from multiprocessing's fork server, a child of the API process."""
    tree = _children()
    servers = [child for child in tree.get(pid, []) if "forkserver" in _cmdline(child)]
    return [rank for server in servers for rank in tree.get(server, [])]


def _is_rank(pid: int) -> bool:
    return _alive(pid) and "forkserver" in _cmdline(pid) and pid not in _children().get(os.getpid(), [])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_server(checkpoint, tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "dsinfer.cli", "serve", str(checkpoint), "--port", str(port),
               "--served-model-name", "tiny", "--max-model-len", "512", "--device", "cpu",
               "--data-parallel-size", "2", "--expert-parallel-size", "2", "--drain-timeout", "20"]  # fmt: skip
    log = open(tmp_path / "server.log", "w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return process, base, log
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise AssertionError(f"the server did not start: {(tmp_path / 'server.log').read_text()[-2000:]}")


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def test_a_rank_killed_makes_health_503_then_the_server_exits_naming_it(tiny_checkpoint, tmp_path):
    shm_before = _shm()
    process, base, log = _start_server(tiny_checkpoint, tmp_path)
    try:
        everything = _descendants(process.pid)
        ranks = _rank_pids(process.pid)
        assert len(ranks) == 2, [(p, _cmdline(p)) for p in everything]
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 400, "ignore_eos": True}
        outcome: dict = {}

        def in_flight() -> None:
            try:
                outcome["status"] = httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code
            except httpx.HTTPError as exc:
                outcome["error"] = exc

        request = threading.Thread(target=in_flight)
        request.start()
        time.sleep(0.5)
        os.kill(ranks[1], signal.SIGKILL)
        killed_at, saw_503 = time.monotonic(), False
        while time.monotonic() - killed_at < 5:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 503:
                    saw_503 = True
                    break
            except httpx.TimeoutException:  # a loaded machine: ask again
                continue
            except httpx.HTTPError:  # the server is gone
                break
            time.sleep(0.05)
        assert saw_503, "/health did not answer 503 within 5 s"
        request.join(timeout=30)
        assert not request.is_alive()
        assert outcome.get("status", 500) >= 500 or "error" in outcome  # ended with an error, not a hang
        assert process.wait(timeout=30) != 0
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert "rank 1" in text and "dsinfer serve: error" in text, text[-3000:]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in everything):
        time.sleep(0.1)
    assert not [p for p in everything if _alive(p)]
    assert _shm() <= shm_before


def test_sigterm_drains_ranks_and_exits_zero(tiny_checkpoint, tmp_path):
    process, base, log = _start_server(tiny_checkpoint, tmp_path)
    try:
        everything = _descendants(process.pid)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 30, "ignore_eos": True}
        outcome: dict = {}
        request = threading.Thread(
            target=lambda: outcome.update(reply=httpx.post(f"{base}/v1/completions", json=body, timeout=60))
        )
        request.start()
        time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        request.join(timeout=60)
        assert outcome["reply"].status_code == 200
        assert outcome["reply"].json()["choices"][0]["finish_reason"] == "length"
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in everything):
        time.sleep(0.1)
    assert not [p for p in everything if _alive(p)]
