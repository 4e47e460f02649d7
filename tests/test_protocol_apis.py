"""The Responses and Messages APIs, chat /tokenize and forced tool calls on the real server (tiny model).

Driven by the official ``openai`` and ``anthropic`` clients over 127.0.0.1.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import deepseek_recipe as recipe
import httpx
import openai
import pytest
from server_harness import running_server

from dsinfer.config import EngineConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
# Bounded values: a random tiny model would otherwise write one endless string.
LOOKUP = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "enum": ["news", "weather", "sports"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
        "fresh": {"type": "boolean"},
    },
    "required": ["topic", "count"],
}
TOOLS = [
    {"type": "function", "function": {"name": "lookup", "description": "Find facts", "parameters": LOOKUP}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=4000)
    with running_server(tiny_checkpoint, config) as (base, engine):
        yield base, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0, timeout=120)


def test_responses_create_non_stream_and_stream_agree(client):
    kwargs = {"model": "tiny", "input": "Say something.", "instructions": "Be terse.", "max_output_tokens": 8,
              "temperature": 0}  # fmt: skip
    full = client.responses.create(**kwargs)
    assert full.status == "incomplete" and full.usage.output_tokens == 8 and full.output_text
    events = list(client.responses.create(**kwargs, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == full.output_text
    assert events[-1].response.usage.input_tokens == full.usage.input_tokens


def test_messages_create_non_stream_and_stream_agree(claude):
    kwargs = {"model": "tiny", "max_tokens": 8, "extra_body": {"temperature": 0}, "system": "Be terse.",
              "messages": [{"role": "user", "content": "Say something."}]}  # fmt: skip
    full = claude.messages.create(**kwargs)
    assert full.stop_reason == "max_tokens" and full.usage.output_tokens == 8
    text = "".join(block.text for block in full.content if block.type == "text")
    events = list(claude.messages.create(**kwargs, stream=True))
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert streamed == text
    with claude.messages.stream(**kwargs) as stream:
        assert stream.get_final_message().content[0].text == text


def test_messages_thinking_blocks(claude):
    thinking = {"type": "enabled", "budget_tokens": 1024}
    full = claude.messages.create(model="tiny", max_tokens=6, extra_body={"temperature": 0}, thinking=thinking,
                                  messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    # The random model never closes </think>: everything is thinking.
    assert [block.type for block in full.content] == ["thinking"] and full.content[0].thinking


def test_messages_errors_are_anthropic_shaped(server, claude):
    base, _ = server
    for body, needle in [
        ({"model": "tiny", "max_tokens": 3, "messages": [{"role": "wizard", "content": "x"}]}, "wizard"),
        ({"model": "tiny", "max_tokens": "many", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"model": "gpt-9", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}, "gpt-9"),
    ]:
        response = httpx.post(f"{base}/v1/messages", json=body, timeout=30)
        assert 400 <= response.status_code < 500
        error = response.json()
        assert error["type"] == "error" and needle in error["error"]["message"], error
    response = httpx.post(f"{base}/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="tiny", max_tokens=3, messages=[])
    # The server still serves after the errors (greedy: a sampled first token could be the end of the turn).
    served = claude.messages.create(model="tiny", max_tokens=4, extra_body={"temperature": 0},
                                    messages=[{"role": "user", "content": "x"}])  # fmt: skip
    assert served.usage.output_tokens > 0 and served.content


def test_responses_bad_input_names_the_field(server):
    base, _ = server
    response = httpx.post(f"{base}/v1/responses", json={"model": "tiny", "input": "x", "temperature": "hot"})
    assert response.status_code == 400 and "temperature" in response.json()["error"]["message"]
    response = httpx.post(f"{base}/v1/responses", json={"model": "tiny", "input": "x", "max_output_tokens": 10**9})
    assert response.status_code == 400 and "max_tokens" in response.json()["error"]["message"]


@pytest.mark.parametrize("variant_name", ["DeepSeek-V4-Pro"])
def test_tokenize_chat_returns_the_ids_the_engine_runs(server, client, tiny_checkpoint, variant_name):
    base, _ = server
    fields = {"messages": CHAT, "tools": TOOLS, "tool_choice": "required",
              "chat_template_kwargs": {"thinking": False}}  # fmt: skip
    tokens = httpx.post(f"{base}/tokenize", json={"model": "tiny", **fields}).json()["tokens"]
    # The library alone, with its own name for the checkpoint's model version, encodes the same ids.
    oracle_body = {"model": variant_name, "messages": CHAT, "tools": TOOLS, "tool_choice": "required",
                   "thinking": {"type": "disabled"}}  # fmt: skip
    conversation = recipe.ChatCompletionRequest(oracle_body).convert(recipe.ConversionOptions()).conversation
    oracle_tokenizer = recipe.Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    assert tokens == list(recipe.DeepseekV4Encoding().with_tokenizer(oracle_tokenizer).encode(conversation))
    out = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                         max_tokens=1)  # fmt: skip
    assert out.usage.prompt_tokens == len(tokens)
    thinking = {"model": "tiny", "messages": CHAT, "reasoning_effort": "max", "response_format": {"type": "text"}}
    with_prompt = httpx.post(f"{base}/tokenize", json=thinking).json()["tokens"]
    without = httpx.post(f"{base}/tokenize", json={**thinking, "add_generation_prompt": False}).json()["tokens"]
    assert with_prompt[: len(without)] == without and len(with_prompt) == len(without) + 2


def _validate(arguments: dict) -> None:
    assert set(arguments) <= set(LOOKUP["properties"]) and {"topic", "count"} <= set(arguments)
    assert arguments["topic"] in ("news", "weather", "sports")
    assert isinstance(arguments["count"], int) and 1 <= arguments["count"] <= 9
    assert isinstance(arguments.get("fresh", True), bool)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "lookup"}}],
                         ids=["required", "named"])  # fmt: skip
def test_forced_tool_choice_returns_a_schema_valid_call_every_time(client, choice):
    def request(seed: int):
        return client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=400,
            temperature=1.0,
            seed=seed,
            parallel_tool_calls=False,
        )  # a random model would call without end

    # The twenty seeded requests arrive at once, as from concurrent clients: the engine decodes them in batches,
    # each with its own grammar (a call is ~200 tokens; one at a time they took minutes on two CPU cores).
    with ThreadPoolExecutor(max_workers=20) as pool:
        outs = list(pool.map(request, range(20)))
    valid = 0
    for seed, out in enumerate(outs):
        result = out.choices[0]
        assert result.finish_reason == "tool_calls", (seed, result)
        assert result.message.tool_calls, (seed, result)
        for call in result.message.tool_calls:
            if call.function.name == "ping":
                assert choice == "required" and json.loads(call.function.arguments) == {}
            else:
                assert call.function.name == "lookup"
                _validate(json.loads(call.function.arguments))
        assert len(result.message.tool_calls) == 1
        valid += 1
    assert valid == 20


def test_forced_tool_call_streams_and_auto_stays_free(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=400, seed=1,
                                                 tool_choice={"type": "function", "function": {"name": "lookup"}},
                                                 stream=True))  # fmt: skip
    arguments = "".join(c.choices[0].delta.tool_calls[0].function.arguments or ""
                        for c in chunks if c.choices and c.choices[0].delta.tool_calls)  # fmt: skip
    _validate(json.loads(arguments))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    free = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="auto", max_tokens=6,
                                          temperature=0)  # fmt: skip
    assert free.choices[0].finish_reason == "length" and not free.choices[0].message.tool_calls


def test_responses_and_messages_forced_tool_calls(client, claude):
    response_tool = {"type": "function", "name": "lookup", "parameters": LOOKUP}
    with ThreadPoolExecutor(max_workers=2) as pool:  # the two calls decode together
        response = pool.submit(client.responses.create, model="tiny", input="Find news", tools=[response_tool],
                               tool_choice="required", max_output_tokens=400, parallel_tool_calls=False)  # fmt: skip
        messages = pool.submit(claude.messages.create, model="tiny", max_tokens=400,
                               messages=[{"role": "user", "content": "news"}],
                               tools=[{"name": "lookup", "input_schema": LOOKUP}],
                               tool_choice={"type": "tool", "name": "lookup"})  # fmt: skip
        out, message = response.result(), messages.result()
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls and calls[0].name == "lookup"
    _validate(json.loads(calls[0].arguments))
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and uses and uses[0].name == "lookup"
    _validate(uses[0].input)
