"""The real server on 127.0.0.1 with the tiny model, driven by the official ``openai`` client and httpx."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from server_harness import metric_value, running_server

from dsinfer.config import EngineConfig

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with running_server(tiny_checkpoint) as (base, engine):
        yield base, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_health_and_metrics(server, client):
    base, _ = server
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    text = httpx.get(f"{base}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "spec_decode_num_drafts_total"):  # fmt: skip
        assert f"dsinfer:{name}" in text, name


def test_chat_non_stream_and_stream_agree(client):
    kwargs = {"model": "tiny", "messages": CHAT, "max_tokens": 12, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # The library's chunks go out as it wrote them where nothing needs an edit: one id and date throughout, no
    # usage before the last chunk, every choice index 0.
    assert len({(c.id, c.created) for c in chunks}) == 1 and all(c.usage is None for c in chunks[:-1])
    assert all(choice.index == 0 for c in chunks for choice in c.choices)


def test_n_seed_and_stop(client):
    kwargs = {"model": "tiny", "messages": CHAT, "max_tokens": 10, "temperature": 1.0, "seed": 42, "n": 3}
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert len(first.choices) == 3
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert len({c.message.content for c in first.choices}) > 1
    streamed: dict[int, str] = {}  # each choice's chunks carry its index (choice 0's as the library wrote them)
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert streamed == {index: choice.message.content for index, choice in enumerate(first.choices)}
    text = first.choices[0].message.content
    stop = text[3:5] if len(text) > 5 and text[3:5].strip() else None
    if stop:
        cut = client.chat.completions.create(**{**kwargs, "n": 1, "stop": [stop]})
        assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].message.content


def test_text_completions(client):
    out = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
    chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text


def test_json_schema_output_validates(client):
    schema = {
        "type": "object",
        # Bounded values: a random tiny model would otherwise write one endless string.
        "properties": {
            "name": {"type": "string", "enum": ["ann", "bob"]},
            "age": {"type": "integer", "maximum": 120, "minimum": 0},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=100, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )  # fmt: skip
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"name", "age"} and value["name"] in ("ann", "bob") and 0 <= value["age"] <= 120
    assert out.choices[0].finish_reason == "stop"


def test_tokenize_round_trip(server):
    base, _ = server
    ids = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()["tokens"]
    assert httpx.post(f"{base}/detokenize", json={"tokens": ids}).json()["prompt"] == "Hello world"


BAD_REQUESTS = [
    ("malformed JSON", b'{"model": "tiny", "messages": [', 400, "malformed JSON"),
    ("wrong type", {"model": "tiny", "messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ("negative max_tokens", {"model": "tiny", "messages": CHAT, "max_tokens": -3}, 400, "max_tokens"),
    ("n = 0", {"model": "tiny", "messages": CHAT, "n": 0}, 400, "n"),
    ("prompt too long", {"model": "tiny", "messages": [{"role": "user", "content": "word " * 1500}]}, 400,
     "maximum context length"),
    ("unknown model", {"model": "gpt-9", "messages": CHAT}, 404, "gpt-9"),
    ("empty messages", {"model": "tiny", "messages": []}, 400, "messages"),
    ("invalid json_schema", {"model": "tiny", "messages": CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "not-a-type"}}}}, 400, "schema"),
    ("bad role", {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "body", "status", "needle"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_a_clear_4xx_and_the_server_keeps_serving(server, client, case, body, status, needle):
    base, _ = server
    if isinstance(body, bytes):
        response = httpx.post(f"{base}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(f"{base}/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle in error["message"] or needle == error.get("param"), error
    ok = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0)
    assert ok.choices[0].message.content is not None


def test_dropped_streams_free_their_cache(server):
    base, engine = server

    def drop_midway():
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": CHAT, "max_tokens": 400, "stream": True, "ignore_eos": True,
        }) as response:  # fmt: skip
            for count, _line in enumerate(response.iter_lines()):
                if count >= 4:
                    return  # closing the connection mid-generation

    threads = [threading.Thread(target=drop_midway) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and metric_value(base, "dsinfer:kv_cache_blocks_in_use") > 0:
        time.sleep(0.05)
    assert metric_value(base, "dsinfer:kv_cache_blocks_in_use") == 0
    assert metric_value(base, "dsinfer:num_requests_running") == 0
    assert metric_value(base, "dsinfer:generation_tokens_total") < 20 * 400  # they really stopped early


def test_queue_limit_answers_429(tiny_checkpoint):
    config = EngineConfig(max_num_seqs=1, max_num_batched_tokens=256, max_model_len=512)
    with running_server(tiny_checkpoint, config, max_queue=1) as (base, _):
        body = {"model": "tiny", "messages": CHAT, "max_tokens": 300, "ignore_eos": True}
        with httpx.Client(timeout=60) as http:
            results = []

            def send():
                results.append(http.post(f"{base}/v1/chat/completions", json=body))

            threads = [threading.Thread(target=send) for _ in range(4)]
            for thread in threads:
                thread.start()
                time.sleep(0.2)
            for thread in threads:
                thread.join()
        statuses = sorted(r.status_code for r in results)
        assert 429 in statuses and 200 in statuses
        rejected = next(r for r in results if r.status_code == 429)
        assert rejected.headers["retry-after"] and "max-queue" in rejected.json()["error"]["message"]


def test_request_timeout_ends_the_request(tiny_checkpoint):
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=4000)
    with running_server(tiny_checkpoint, config, request_timeout=0.5) as (base, _):
        response = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": CHAT, "max_tokens": 3500, "ignore_eos": True})  # fmt: skip
        assert response.status_code == 408 and "request-timeout" in response.json()["error"]["message"]
        assert metric_value(base, "dsinfer:kv_cache_blocks_in_use") == 0


def test_thinking_mode_streams_reasoning(client):
    kwargs = {"model": "tiny", "messages": CHAT, "max_tokens": 10, "temperature": 0, "reasoning_effort": "high"}
    full = client.chat.completions.create(**kwargs)
    message = full.choices[0].message
    # The random model never closes </think>, so everything it writes is reasoning.
    assert message.reasoning_content and not message.content
    assert message.reasoning == message.reasoning_content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == message.reasoning_content
    deltas = [c.choices[0].delta for c in chunks if c.choices and getattr(c.choices[0].delta, "reasoning_content", "")]
    assert deltas and all(delta.reasoning == delta.reasoning_content for delta in deltas)  # vLLM's newer name too


def test_tools_are_accepted_and_tool_choice_validated(server, client):
    base, _ = server
    parameters = {"type": "object", "properties": {"q": {"type": "string"}}}
    tools = [
        {"type": "function", "function": {"name": "lookup", "description": "Find a fact", "parameters": parameters}}
    ]
    for choice in ("auto", "none", "required", {"type": "function", "function": {"name": "lookup"}}):
        out = client.chat.completions.create(model="tiny", messages=CHAT, tools=tools, tool_choice=choice, max_tokens=4)
        assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")
    unknown = {"type": "function", "function": {"name": "nope"}}
    body = {"model": "tiny", "messages": CHAT, "tools": tools, "tool_choice": unknown}
    response = httpx.post(f"{base}/v1/chat/completions", json=body)
    assert response.status_code == 400 and "nope" in response.json()["error"]["message"]
