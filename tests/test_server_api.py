"""OpenAI semantics of the API surface: context-length 400s naming the right field, the n limit, parameter
ranges, GET /v1/models/{id}, batched prompts and logprobs offsets in /v1/completions."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server_harness import running_server

from dsinfer.config import EngineConfig

CHAT = [{"role": "user", "content": "Say something."}]
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=MAX_MODEL_LEN)
    with running_server(tiny_checkpoint, config, max_n=6) as (url, _engine):
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error", error
    return error


def prompt_tokens(base: str, text: str) -> int:
    return httpx.post(f"{base}/tokenize", json={"prompt": text}).json()["count"]


def test_context_overflow_is_a_400_naming_the_field_to_shorten(base):
    long_text = "word " * 400
    chat = httpx.post(f"{base}/v1/chat/completions", json={"messages": [{"role": "user", "content": long_text}]})
    assert error_of(chat)["param"] == "messages"
    text = httpx.post(f"{base}/v1/completions", json={"prompt": long_text})
    error = error_of(text)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert "messages" not in error["message"] and f"maximum context length is {MAX_MODEL_LEN}" in error["message"]

    # The prompt fits, the prompt plus the completion does not: OpenAI names the completion-length field.
    too_long = MAX_MODEL_LEN  # any prompt has at least one token
    for route, body, field in [
        ("completions", {"prompt": "Hello", "max_tokens": too_long}, "max_tokens"),
        ("chat/completions", {"messages": CHAT, "max_tokens": too_long}, "max_tokens"),
        ("chat/completions", {"messages": CHAT, "max_completion_tokens": too_long}, "max_completion_tokens"),
    ]:
        error = error_of(httpx.post(f"{base}/v1/{route}", json=body))
        assert error["param"] == field and error["code"] == "context_length_exceeded", (route, error)
        assert "in the completion" in error["message"]


def test_a_completion_that_exactly_fills_the_context_runs(base):
    room = MAX_MODEL_LEN - prompt_tokens(base, "Hello")
    body = {"prompt": "Hello", "max_tokens": room, "ignore_eos": True, "temperature": 0}
    out = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
    assert out["usage"]["completion_tokens"] == room and out["choices"][0]["finish_reason"] == "length"
    # Without max_tokens the default is lowered to the room a long prompt leaves instead of failing.
    long_prompt = "word " * 60
    left = MAX_MODEL_LEN - prompt_tokens(base, long_prompt)
    assert 0 < left < 256  # the server's default max_tokens is 256
    out = httpx.post(f"{base}/v1/completions", json={"prompt": long_prompt, "ignore_eos": True}, timeout=120).json()
    assert out["usage"]["completion_tokens"] == left


def test_n_above_the_limit_is_a_400(base):
    error = error_of(httpx.post(f"{base}/v1/chat/completions", json={"messages": CHAT, "n": 7}))
    assert error["param"] == "n" and "--max-n" in error["message"] and "6" in error["message"]
    error = error_of(httpx.post(f"{base}/v1/completions", json={"prompt": ["a", "b", "c", "d"], "n": 2}))
    assert error["param"] == "n" and "8 completions" in error["message"]
    ok = httpx.post(f"{base}/v1/chat/completions", json={"messages": CHAT, "n": 6, "max_tokens": 2}, timeout=60)
    assert len(ok.json()["choices"]) == 6


RANGES = [
    ({"temperature": 5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"top_logprobs": 3}, "top_logprobs"),  # top_logprobs needs logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": True}, "n"),  # a boolean is not a number
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"min_p": 2}, "min_p"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
]


@pytest.mark.parametrize(("fields", "param"), RANGES, ids=[json.dumps(f) for f, _ in RANGES])
def test_out_of_range_parameters_are_refused_like_openai(base, fields, param):
    error = error_of(httpx.post(f"{base}/v1/chat/completions", json={"messages": CHAT, **fields}))
    assert error["param"] == param, error


def test_edges_of_the_documented_ranges_are_accepted(client):
    edges = {"temperature": 2, "top_p": 1, "presence_penalty": -2, "frequency_penalty": 2, "top_logprobs": 20}
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, logprobs=True, seed=0, **edges)
    # Answer tokens list under content, reasoning tokens under reasoning_content (DeepSeek's API): a sampled
    # reply of two tokens may hold either.
    logprobs = out.choices[0].logprobs
    entries = (logprobs.content or []) + (getattr(logprobs, "reasoning_content", None) or [])
    assert entries and len(entries[0].top_logprobs) == 20


def test_completions_logprobs_range_and_text_offset(base):
    error = error_of(httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "logprobs": 21}))
    assert error["param"] == "logprobs"
    body = {"prompt": "Hello", "max_tokens": 5, "logprobs": 2, "temperature": 0, "ignore_eos": True}
    prompt_ids = httpx.post(f"{base}/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    echoed = httpx.post(f"{base}/detokenize", json={"tokens": prompt_ids}).json()["prompt"]
    for echo in (False, True):
        choice = httpx.post(f"{base}/v1/completions", json={**body, "echo": echo}, timeout=60).json()["choices"][0]
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["text_offset"]) == 5
        start = len(echoed) if echo else 0  # offsets count from the start of the returned text
        assert choice["text"].startswith(echoed) == echo or echoed == ""
        expected = [start + len("".join(logprobs["tokens"][:i])) for i in range(5)]
        assert logprobs["text_offset"] == expected
        assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    streamed = [tok for e in events for tok in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]
    offsets = [o for e in events for o in (e["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    assert streamed == logprobs["tokens"] and offsets == [len("".join(streamed[:i])) for i in range(5)]


def test_get_one_model(base, client):
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    missing = httpx.get(f"{base}/v1/models/gpt-9")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found" and "gpt-9" in missing.json()["error"]["message"]
    assert httpx.get(f"{base}/v1/models/org/name").status_code == 404  # ids with a slash reach the route too


def test_batched_prompts_match_single_requests(base, client):
    texts = ["Hello", "The quick brown fox", "Once upon"]
    kwargs = {"model": "tiny", "max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    singles = [client.completions.create(prompt=t, **kwargs).choices[0].text for t in texts]
    batch = client.completions.create(prompt=texts, **kwargs, n=2)
    assert sorted(c.index for c in batch.choices) == list(range(6))
    by_index = {c.index: c.text for c in batch.choices}
    assert [by_index[2 * i] for i in range(3)] == singles and [by_index[2 * i + 1] for i in range(3)] == singles
    assert batch.usage.completion_tokens == 30
    assert batch.usage.prompt_tokens == sum(prompt_tokens(base, t) for t in texts)

    ids = [httpx.post(f"{base}/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    by_ids = client.completions.create(prompt=ids, **kwargs)
    assert [c.text for c in sorted(by_ids.choices, key=lambda c: c.index)] == singles

    usage = {"include_usage": True}
    chunks = list(client.completions.create(prompt=texts, **kwargs, stream=True, stream_options=usage))
    streamed: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == singles
    assert chunks[-1].usage.completion_tokens == 15


def test_bad_prompts_in_a_batch_are_refused(base):
    for prompt, needle in [([[1, 2], []], "empty"), ([[1, 10**9]], "token ids"), ([[-1]], "token ids")]:
        error = error_of(httpx.post(f"{base}/v1/completions", json={"prompt": prompt}))
        assert error["param"] == "prompt" and needle in error["message"], error


def test_streams_with_n_end_each_choice_once(base):
    """Choices finish at different steps (random lengths): each gets one finish chunk, and the text matches."""
    body = {"messages": CHAT, "n": 6, "max_tokens": 40, "temperature": 1.0, "seed": 3, "stop": ["e", "a"]}
    full = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
    lengths = {c["message"]["content"] for c in full["choices"]}
    assert len(lengths) > 1  # the choices did not all end together
    with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    finishes = [e["choices"][0]["index"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert sorted(finishes) == list(range(6))
    text = {i: "" for i in range(6)}
    for event in events:
        for choice in event["choices"]:
            text[choice["index"]] += choice["delta"].get("content") or ""
    assert [text[i] for i in range(6)] == [c["message"]["content"] for c in full["choices"]]
    completion = {"prompt": "Hello", "n": 6, "max_tokens": 40, "seed": 3, "stop": ["e", "a"], "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=completion, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    finishes = [e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]]
    assert sorted(finishes) == list(range(6))


def test_errors_name_the_field_without_pydantic_internals(base):
    error = error_of(httpx.post(f"{base}/v1/completions", json={"prompt": 5}))
    assert error["param"] == "prompt" and "[" not in error["message"].split(":")[0]
    error = error_of(httpx.post(f"{base}/v1/completions", json={"prompt": [[1, 1.5]]}))
    assert error["param"] == "prompt.0.1", error
    error = error_of(httpx.post(f"{base}/v1/chat/completions", json={"messages": CHAT, "tool_choice": "x"}))
    assert error["param"] == "tool_choice"
    error = error_of(
        httpx.post(f"{base}/v1/chat/completions", json={"messages": CHAT, "min_tokens": 9, "max_tokens": 3})
    )
    assert error["param"] == "min_tokens" and "max_tokens" in error["message"]


def test_openapi_documents_400_and_the_servers_limits(base):
    schema = httpx.get(f"{base}/openapi.json").json()
    assert "422" not in json.dumps(schema["paths"]) and "HTTPValidationError" not in json.dumps(schema)
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "404", "408", "429", "503"} <= set(chat)
    assert chat["400"]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/ErrorResponse"
    assert set(chat["200"]["content"]) == {"application/json", "text/event-stream"}
    request = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert request["n"]["maximum"] == 6 and request["temperature"]["anyOf"][0]["maximum"] == 2
    assert request["model"]["anyOf"][0]["enum"] == ["tiny"]
    assert "/v1/models/{model_id}" in schema["paths"]
