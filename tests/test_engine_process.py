"""``dsinfer serve``'s default with one rank: the engine steps in a process of its own (the API process holds no
weights). Through the official ``openai`` client it answers as the in-process engine does (greedy text, streams,
logprobs, speculative decoding), a client that leaves or runs past ``--request-timeout`` frees its request in the
engine process, bad input is a 4xx and the server goes on, the counters reach /metrics, and an engine process that
dies makes /health 503 and the server exit non-zero, leaving no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_harness import free_port, metric_value, running_server
from test_ranks import _alive, _descendants, _rank_pids

from dsinfer.config import ConfigError, EngineConfig
from dsinfer.llm import LLM
from dsinfer.parallel.ranked_engine import RankedEngine
from dsinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=512)
PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def expected(tiny_checkpoint):
    """The in-process engine's greedy completions (text, token logprobs) of ``PROMPTS``."""
    with LLM(tiny_checkpoint, CONFIG) as llm:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(out.outputs[0].text, out.outputs[0].logprobs) for out in outputs]


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    with running_server(tiny_checkpoint, CONFIG, engine_process=True) as (base, engine):
        assert isinstance(engine.engine, RankedEngine) and engine.engine.model.config.vocab_size > 0
        pid = engine.engine.pids[0]
        yield base, engine, openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    _assert_gone([pid])  # the engine process does not outlive its server


def test_greedy_text_logprobs_and_streams_equal_the_in_process_engine(served, expected):
    base, engine, client = served
    for prompt, (text, logprobs) in zip(PROMPTS, expected, strict=True):
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                                          extra_body={"ignore_eos": True})  # fmt: skip
        assert reply.choices[0].text == text
        assert reply.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-5)
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        chunks = [chunk.choices[0].text for chunk in stream if chunk.choices]
        assert len(chunks) > 1 and "".join(chunks) == text
    assert metric_value(base, "dsinfer:generation_tokens_total") >= 6 * 8


def _stop_cases(text: str) -> list[SamplingParams]:
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cases = [dict(stop=[stop]), dict(stop=[stop], include_stop_str_in_output=True),
             dict(stop=[stop, "zz"], n=2, temperature=1.0, seed=3), dict(stop=[stop], logprobs=1)]  # fmt: skip
    return [SamplingParams(**{"temperature": 0, "max_tokens": 8, "ignore_eos": True, **case}) for case in cases]


def test_stop_strings_are_found_in_the_api_process_as_in_process(tiny_checkpoint, expected):
    """The engine process makes no text (it runs every request with detokenize=False and no stop strings): this
    process detokenizes, finds stop strings (kept or not, n > 1 with a seed, with logprobs) and ends the request
    in the engine process."""
    cases = _stop_cases(expected[1][0])
    with LLM(tiny_checkpoint, CONFIG) as llm:
        want = [llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs for params in cases]
    with LLM(tiny_checkpoint, CONFIG, engine_process=True) as llm:
        sent, send = [], llm.engine._send
        llm.engine._send = lambda rank, message: (sent.append(message), send(rank, message))
        got = [llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs for params in cases]
        deadline = time.monotonic() + 10  # a stop string's abort reaches the engine process after the last report
        while llm.engine.load().running or llm.engine.load().blocks_used:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert not llm.engine.requests
    for case, mine, theirs in zip(cases, got, want, strict=True):
        assert [(c.text, c.token_ids, c.finish_reason) for c in mine] == [
            (c.text, c.token_ids, c.finish_reason) for c in theirs
        ], case
        for a, b in zip([c.logprobs for c in mine], [c.logprobs for c in theirs], strict=True):
            # another process: float32 logits may differ in the last bits (the thread split of a CPU matmul)
            assert (a is None and b is None) or a == pytest.approx(b, abs=1e-5)
    assert any(c.finish_reason == "stop" for outputs in want for c in outputs)  # a stop string did end one early
    adds = [m for m in sent if type(m).__name__ == "AddRequest"]
    assert len(adds) == len(cases) and all(not m.params.detokenize and not m.params.stop for m in adds)


def test_served_stop_strings_stream_as_in_process(served, tiny_checkpoint, expected):
    base, _, client = served
    for params in _stop_cases(expected[1][0])[::2]:
        with LLM(tiny_checkpoint, CONFIG) as llm:
            want = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs
        body = {"n": params.n, "temperature": params.temperature, "seed": params.seed, "stop": params.stop,
                "ignore_eos": True}  # fmt: skip
        reply = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, extra_body=body)
        got = sorted(reply.choices, key=lambda c: c.index)
        assert [(c.text, c.finish_reason) for c in got] == [(w.text, w.finish_reason) for w in want], params
        stream = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, stream=True, extra_body=body)
        streamed = [""] * params.n
        for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] += choice.text
        assert streamed == [w.text for w in want], params


def test_a_client_that_leaves_frees_its_request_in_the_engine_process(served):
    base, engine, client = served
    generated = metric_value(base, "dsinfer:generation_tokens_total")
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell a story"}],
                                            max_tokens=400, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    for index, _ in enumerate(stream):
        if index == 3:  # the engine process's counters reach /metrics while it runs
            assert metric_value(base, "dsinfer:num_requests_running") == 1
            assert engine.engine.load().num_blocks > 0
            break
    stream.close()
    deadline = time.monotonic() + 10
    gauges = ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_in_use")
    while any(metric_value(base, f"dsinfer:{g}") for g in gauges) or engine.engine.requests:
        assert time.monotonic() < deadline, {g: metric_value(base, f"dsinfer:{g}") for g in gauges}
        time.sleep(0.02)
    assert engine.engine.load().blocks_used == 0 and not engine.engine.load().running
    assert metric_value(base, "dsinfer:generation_tokens_total") - generated < 200  # stopped long before the end


def test_bad_requests_get_a_4xx_and_the_server_goes_on(served, expected):
    base, _, client = served
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[10**9], max_tokens=4)  # a token id past the vocabulary
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[5] * 600, max_tokens=4)  # past --max-model-len
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=-1)
    response = httpx.post(f"{base}/v1/completions", content=b"{not json", timeout=10,
                          headers={"content-type": "application/json"})  # fmt: skip
    assert 400 <= response.status_code < 500
    reply = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    assert reply.choices[0].text == expected[0][0]


def test_speculative_decoding_runs_in_the_engine_process(tiny_checkpoint):
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=128, max_model_len=256, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(tiny_checkpoint, config) as llm:
        expected = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    with running_server(tiny_checkpoint, config, engine_process=True) as (base, engine):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        for prompt, want in zip(PROMPTS[:2], expected, strict=True):
            reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                                              extra_body={"ignore_eos": True})  # fmt: skip
            assert reply.choices[0].text == want.outputs[0].text
        drafts = metric_value(base, "dsinfer:spec_decode_num_drafts_total")
        stats = engine.engine.spec_stats
    assert drafts == stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts


def test_an_engine_process_that_fails_to_start_raises_the_in_process_error(tiny_v41_checkpoint):
    """A speculative method the checkpoint cannot run is a ConfigError naming it, as in-process."""
    with pytest.raises(ConfigError, match="'mtp' needs V4's MTP layers"):
        LLM(
            tiny_v41_checkpoint,
            engine_process=True,
            speculative_config='{"method": "mtp", "num_speculative_tokens": 1}',
        )


def test_deadlines_then_a_killed_engine_process_makes_health_503_and_the_server_exit_nonzero(tiny_checkpoint, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "dsinfer.cli", "serve", str(tiny_checkpoint), "--port", str(port),
               "--served-model-name", "tiny", "--max-model-len", "512", "--device", "cpu",
               "--request-timeout", "1"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "server.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 120
            while process.poll() is None and time.monotonic() < deadline:
                try:
                    if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 450, "ignore_eos": True}
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert response.status_code == 408 and "request-timeout" in response.json()["error"]["message"]
            deadline = time.monotonic() + 5  # the abort reaches the engine process a moment after the answer
            while metric_value(base, "dsinfer:kv_cache_blocks_in_use") or metric_value(
                base, "dsinfer:num_requests_running"
            ):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            everything = _descendants(process.pid)
            engines = _rank_pids(process.pid)
            assert len(engines) == 1, everything
            os.kill(engines[0], signal.SIGKILL)
            killed_at, saw_503 = time.monotonic(), False
            while not saw_503 and time.monotonic() - killed_at < 5:
                try:
                    saw_503 = httpx.get(f"{base}/health", timeout=1).status_code == 503
                except httpx.HTTPError:
                    break
                time.sleep(0.05)
            assert saw_503, "/health did not answer 503 within 5 s"
            assert process.wait(timeout=30) != 0
        finally:
            if process.poll() is None:
                process.kill()
    text = (tmp_path / "server.log").read_text()
    assert "the engine process" in text and "dsinfer serve: error" in text, text[-3000:]
    _assert_gone(everything)


def _assert_gone(pids: list[int], within: float = 10.0) -> None:
    """Every process of ``pids`` exits within ``within`` seconds (the fork server and the engine process too)."""
    deadline = time.monotonic() + within
    while (left := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, left
