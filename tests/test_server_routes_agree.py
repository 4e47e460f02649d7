"""The embedded default model through every route: what one request gives must not depend on the route or on
streaming. Tool arguments through ``/v1/messages`` equal chat completions' for the same seeded request, streamed
chat logprobs equal the full answer's, and an answer a stop sequence ends counts as ``stop`` in the metrics,
never as an abort (with the engine in this process and in a process of its own).

Driven by the official ``openai`` and ``anthropic`` clients over 127.0.0.1.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest
from server_harness import running_server

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}  # fmt: skip
TOOLS = [("get_weather", "Get the weather for a city", CITY), ("add_person", "Add a person", PERSON)]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Madrid?"}]
ASK_SUM = [{"role": "user", "content": "What is 12 + 35?"}]


@pytest.fixture(scope="module")
def server():
    with running_server(None, served_model_name="default") as (base, engine):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0, timeout=120)


def test_messages_tool_arguments_equal_chat_completions_for_the_same_request(client, claude):
    """Sampled (temperature 1.5), so only the seed makes the routes agree: one that a route ignored would show."""
    chat_tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": p}} for n, d, p in TOOLS]
    messages_tools = [{"name": n, "description": d, "input_schema": p} for n, d, p in TOOLS]
    calls = 0
    for seed in range(3):
        chat = client.chat.completions.create(model="default", messages=ASK_WEATHER, tools=chat_tools, max_tokens=48,
                                              temperature=1.5, seed=seed)  # fmt: skip
        expected = [
            (c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls or []
        ]
        kwargs = {"model": "default", "messages": ASK_WEATHER, "tools": messages_tools, "max_tokens": 48,
                  "extra_body": {"temperature": 1.5, "seed": seed}}  # fmt: skip
        message = claude.messages.create(**kwargs)
        assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == expected, seed
        with claude.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
        assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == expected, seed
        calls += len(expected)
    assert calls >= 2, "the default model stopped calling the tool: the comparison shows nothing"


@pytest.mark.parametrize("thinking", [False, True])
def test_streamed_chat_logprobs_equal_the_full_answers(client, thinking):
    mode = {"type": "enabled" if thinking else "disabled"}
    kwargs = {"model": "default", "messages": ASK_SUM, "max_tokens": 40, "seed": 3, "logprobs": True,
              "top_logprobs": 3, "extra_body": {"thinking": mode}}  # fmt: skip
    full = client.chat.completions.create(**kwargs)
    content, reasoning, answer = [], [], ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        answer += choice.delta.content or ""
        entries = (choice.logprobs.content or []) if choice.logprobs else []
        # Each chunk carries the logprobs of the tokens its delta shows (their bytes make its text).
        assert bytes(b for entry in entries for b in entry.bytes).decode() == (choice.delta.content or "")
        content += entries
        reasoning += ((choice.logprobs.model_extra or {}).get("reasoning_content") or []) if choice.logprobs else []
    assert answer == full.choices[0].message.content and "47" in answer
    assert [e.model_dump() for e in content] == [e.model_dump() for e in full.choices[0].logprobs.content]
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob for e in content)
    full_reasoning = (full.choices[0].logprobs.model_extra or {}).get("reasoning_content") or []
    assert reasoning == full_reasoning and bool(reasoning) == thinking
    assert "<｜end▁of▁sentence｜>" not in [e.token for e in content]  # control tokens are in neither


def finished_count(base: str, reason: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    label = f'finished_reason="{reason}"'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("dsinfer:request_success_total{") and label in line)  # fmt: skip


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_a_stop_sequence_ending_counts_as_stop_not_abort(engine_process):
    """The answer runs on past the stop sequence ("12 + 35 = 47"), so the parser, not the engine, ends it."""
    with running_server(None, served_model_name="default", engine_process=engine_process) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
        stops, aborts = finished_count(base, "stop"), finished_count(base, "abort")
        kwargs = {"model": "default", "messages": ASK_SUM, "max_tokens": 40, "temperature": 0, "stop": ["="]}
        full = client.chat.completions.create(**kwargs)
        assert full.choices[0].finish_reason == "stop" and "=" not in full.choices[0].message.content
        streamed = list(client.chat.completions.create(**kwargs, stream=True))
        assert streamed[-1].choices[0].finish_reason == "stop"
        message = claude.messages.create(model="default", messages=ASK_SUM, max_tokens=40, stop_sequences=["="],
                                         extra_body={"temperature": 0})  # fmt: skip
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == "="
        deadline = time.monotonic() + 10  # the engine thread counts an ended request between its steps
        while finished_count(base, "stop") < stops + 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert finished_count(base, "stop") == stops + 3
        assert finished_count(base, "abort") == aborts
