"""Bodies at the edges of what JSON and the API allow get a 4xx naming the field, never a 5xx, on every route.

A real server (the tiny checkpoint, OpenAI's defaults: ``model`` required) with a 4 MiB body limit: a 10 MB body
is a 413 before it is parsed, a 3 MB prompt is refused as too long without being tokenized, and neither holds
up /health. The fuzz test below sends hypothesis-built bodies (nesting 1-2000 deep, integers up to 2**200, lone
surrogates, NaN / Infinity) to every route over one keep-alive connection.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_harness import running_server

from dsinfer.config import EngineConfig
from dsinfer.server.chat_api import offered_calls_only

MAX_REQUEST_BYTES = 4 * 2**20
CHAT = [{"role": "user", "content": "Hi"}]
BASE_BODIES = {
    "/v1/chat/completions": {"model": "tiny", "messages": CHAT, "max_tokens": 1},
    "/v1/completions": {"model": "tiny", "prompt": "Hi", "max_tokens": 1},
    "/v1/responses": {"model": "tiny", "input": "Hi", "max_output_tokens": 1},
    "/v1/messages": {"model": "tiny", "messages": CHAT, "max_tokens": 1},
    "/tokenize": {"model": "tiny", "prompt": "Hi"},
    "/detokenize": {"model": "tiny", "tokens": [1, 2]},
}
GENERATION_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"]


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024)
    with running_server(tiny_checkpoint, config, require_model=True, max_request_bytes=MAX_REQUEST_BYTES) as (
        url,
        _engine,
    ):
        yield url


@pytest.fixture(scope="module")
def client(base):
    with httpx.Client(base_url=base, timeout=60) as keep_alive:
        yield keep_alive


def post_raw(client: httpx.Client, route: str, text: str) -> httpx.Response:
    return client.post(
        route, content=text.encode("utf-8", "surrogatepass"), headers={"content-type": "application/json"}
    )


def error_param(response: httpx.Response, status: int = 400) -> str | None:
    assert response.status_code == status, response.text
    body = response.json()
    error = body["error"]
    return error.get("param") if "param" in error else error.get("message")  # Anthropic's errors name no param


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth - 1):
        value = {"x": value}
    return value


# ---- JSON shapes ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses", "/v1/messages", "/tokenize"])
def test_deep_nesting_is_a_400_at_every_depth_the_library_cannot_take(client, route):
    for depth in (129, 990, 2000):
        deep = '{"x":' * (depth - 1) + "1" + "}" * (depth - 1)  # json.dumps itself cannot write 2000 levels
        response = post_raw(client, route, json.dumps(BASE_BODIES[route])[:-1] + f', "metadata": {deep}}}')
        assert response.status_code == 400, (depth, response.text)
        assert "nested deeper" in response.text
    shallow = client.post(route, json={**BASE_BODIES[route], "metadata": nested(50)})
    assert shallow.status_code == 200, shallow.text


def test_integers_beyond_64_bits_name_their_field(client):
    for route, field in [
        ("/v1/chat/completions", "seed"),
        ("/v1/completions", "seed"),
        ("/v1/chat/completions", "max_tokens"),
        ("/v1/responses", "max_output_tokens"),
    ]:
        response = client.post(route, json={**BASE_BODIES[route], field: 2**70})
        assert error_param(response) == field, (route, response.text)
    response = client.post("/v1/messages", json={**BASE_BODIES["/v1/messages"], "max_tokens": 2**200})
    assert response.status_code == 400 and "max_tokens" in response.json()["error"]["message"]


def test_lone_surrogates_are_a_400_naming_the_prompt(client):
    for route in ("/v1/completions", "/tokenize"):
        response = post_raw(client, route, '{"model": "tiny", "prompt": "x\\udfffy"}')
        assert error_param(response) == "prompt", response.text
    response = post_raw(
        client, "/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}'
    )
    assert error_param(response) == "messages.0.content"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_nan_and_infinity_name_their_field(client, constant):
    for route in ("/v1/chat/completions", "/v1/completions"):
        text = json.dumps(BASE_BODIES[route])[:-1] + f', "temperature": {constant}}}'
        assert error_param(post_raw(client, route, text)) == "temperature"


# ---- size ----------------------------------------------------------------------------------------------------
def test_a_body_over_the_limit_is_a_413_and_the_connection_stays_usable(client):
    big = json.dumps({"model": "tiny", "prompt": "a" * (MAX_REQUEST_BYTES + 1)})
    response = post_raw(client, "/v1/completions", big)
    assert error_param(response, 413) == "body" and "--max-request-bytes" in response.text
    assert response.headers.get("connection") != "close"

    def chunks():  # no Content-Length: the limit is counted as the body streams in
        for _ in range(12):
            yield b"a" * 2**19

    streamed = client.post("/tokenize", content=chunks(), headers={"content-type": "application/json"})
    assert error_param(streamed, 413) == "body"
    assert client.get("/health").status_code == 200


def health_latencies(base: str, stop: threading.Event) -> list[float]:
    latencies = []
    with httpx.Client(base_url=base, timeout=5) as probe:
        while not stop.is_set():
            start = time.perf_counter()
            assert probe.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.005)
    return latencies


TEXT_FIELDS = {
    "/v1/chat/completions": lambda text: {"messages": [{"role": "user", "content": text}]},
    "/v1/messages": lambda text: {"messages": [{"role": "user", "content": text}]},
    "/v1/completions": lambda text: {"prompt": text},
    "/tokenize": lambda text: {"prompt": text},
    "/v1/responses": lambda text: {"input": text},
    "/detokenize": lambda text: {"user": text},  # not read: the body's size is all that is refused
}


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_huge_bodies_never_hold_up_health_nor_keep_memory(base, client):
    """10 MB bodies (413) and 3 MB prompts (too long for the context, refused without tokenizing) on every
    route: /health answers meanwhile, and the server's memory (this process) comes back."""
    # The bodies are written before the baseline: this process is both the client and the server.
    bodies = [
        (route, size, json.dumps({**BASE_BODIES[route], **TEXT_FIELDS[route]("word " * (size // 5))}).encode())
        for route in BASE_BODIES
        for size in (10 * 10**6, 3 * 10**6)
    ]
    client.post("/tokenize", json={"prompt": "warm up"})
    before = resident_bytes()
    stop = threading.Event()
    latencies: list[float] = []
    prober = threading.Thread(target=lambda: latencies.extend(health_latencies(base, stop)))
    prober.start()
    try:
        for route, size, body in bodies:
            response = client.post(route, content=body, headers={"content-type": "application/json"})
            expected = 413 if size > MAX_REQUEST_BYTES else 200 if route == "/detokenize" else 400
            assert response.status_code == expected, (route, size, response.text[:300])
    finally:
        stop.set()
        prober.join()
    assert len(latencies) >= 3  # the prober ran beside the bodies (how many fit depends on the machine's load)
    assert statistics.median(latencies) < 0.1 and max(latencies) < 0.5, sorted(latencies)[-5:]
    assert resident_bytes() - before < 100 * 2**20


# ---- fields --------------------------------------------------------------------------------------------------
def test_model_is_required_on_generation_routes(client):
    for route in GENERATION_ROUTES:
        body = {k: v for k, v in BASE_BODIES[route].items() if k != "model"}
        response = client.post(route, json=body)
        assert response.status_code == 400, route
        assert "model" in response.text
    assert client.post("/tokenize", json={"prompt": "Hi"}).status_code == 200  # vLLM's route: no model needed


def test_messages_need_max_tokens(client):
    response = client.post("/v1/messages", json={"model": "tiny", "messages": CHAT})
    assert response.status_code == 400 and response.json()["error"]["message"] == "max_tokens: Field required"


def test_routes_agree_on_limits(client):
    for route in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        stops = "stop_sequences" if route == "/v1/messages" else "stop"
        response = client.post(route, json={**BASE_BODIES[route], stops: [str(i) for i in range(17)]})
        assert response.status_code == 400 and "17" in response.text, (route, response.text)
    for route in ("/v1/chat/completions", "/v1/completions"):
        assert error_param(client.post(route, json={**BASE_BODIES[route], "seed": -1})) == "seed"
        assert error_param(client.post(route, json={**BASE_BODIES[route], "seed": 2**63})) == "seed"
    for route, field in [
        ("/v1/chat/completions", "max_tokens"),
        ("/v1/completions", "max_tokens"),
        ("/v1/responses", "max_output_tokens"),
    ]:
        assert error_param(client.post(route, json={**BASE_BODIES[route], field: 10**9})) == field
    response = client.post("/v1/messages", json={**BASE_BODIES["/v1/messages"], "max_tokens": 10**9})
    assert response.status_code == 400 and "maximum context length" in response.text


def test_named_tool_choice_needs_that_tool(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = client.post("/v1/chat/completions", json={**BASE_BODIES["/v1/chat/completions"], "tool_choice": named})
    assert error_param(response) == "tool_choice"
    other = [{"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
    response = client.post(
        "/v1/chat/completions", json={**BASE_BODIES["/v1/chat/completions"], "tool_choice": named, "tools": other}
    )
    assert response.status_code == 400 and "get_weather" in response.text


def test_a_message_that_only_calls_tools_has_null_content(client):
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
    body = {
        "model": "tiny",
        "messages": CHAT,
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 60,
        "temperature": 0,
    }
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["tool_calls"][0]["function"]["name"] == "ping"
    assert message["content"] is None


def test_empty_body_and_bad_schema_name_their_param(client):
    empty = client.post("/v1/chat/completions", content=b"", headers={"content-type": "application/json"})
    assert error_param(empty) == "body"
    assert error_param(post_raw(client, "/v1/completions", "{not json")) == "body"
    for schema in (
        {"type": "strin"},
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
        {"type": "string", "minLength": 10**9},
        {"type": "integer", "minimum": 5, "maximum": 1},
    ):
        response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        body = {**BASE_BODIES["/v1/chat/completions"], "response_format": response_format}
        param = error_param(client.post("/v1/chat/completions", json=body))
        assert param.startswith("response_format"), (schema, param)


def test_head_health(client):
    response = client.head("/health")
    assert response.status_code == 200


def test_vllm_structured_output_fields_constrain_the_text(client):
    choices = ["alpha", "beta"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        body = {**BASE_BODIES["/v1/completions"], "max_tokens": 12, "temperature": 1, "seed": 3, **extra}
        out = client.post("/v1/completions", json=body).json()
        assert out["choices"][0]["text"] in choices, out
    body = {**BASE_BODIES["/v1/completions"], "max_tokens": 8, "guided_regex": "[0-9]{3}", "seed": 1}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"].isdigit()
    body = {**BASE_BODIES["/v1/chat/completions"], "max_tokens": 8, "guided_choice": choices, "temperature": 1}
    assert client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"] in choices
    both = {**body, "guided_regex": "a+"}
    assert error_param(client.post("/v1/chat/completions", json=both)) == "guided_choice"  # the second of two
    assert (
        error_param(client.post("/v1/completions", json={**BASE_BODIES["/v1/completions"], "guided_choice": []}))
        == "guided_choice"
    )


# ---- fuzz ----------------------------------------------------------------------------------------------------
FIELDS = ["seed", "max_tokens", "n", "temperature", "top_k", "metadata", "prompt", "tokens", "stop", "user"]


@st.composite
def edge_values(draw) -> str:
    """JSON text of a value at an edge: deep nesting, huge integers, lone surrogates, NaN / Infinity."""
    kind = draw(st.sampled_from(["nested", "integer", "surrogate", "constant", "list"]))
    if kind == "nested":
        depth = draw(st.one_of(st.integers(1, 140), st.integers(1, 2000)))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        return opener * depth + "0" + closer * depth
    if kind == "integer":
        magnitude = draw(st.integers(0, 200))
        return str(draw(st.sampled_from([1, -1])) * 2**magnitude + draw(st.integers(-2, 2)))
    if kind == "surrogate":
        lone = draw(st.integers(0xD800, 0xDFFF))
        text = draw(st.text(st.characters(codec="utf-8"), max_size=5))
        return json.dumps(text + chr(lone), ensure_ascii=True)
    if kind == "constant":
        return draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"]))
    return "[" + ",".join(draw(st.lists(st.sampled_from(['"x"', "1", "2.5", "null", "[]"]), max_size=20))) + "]"


@st.composite
def edge_requests(draw) -> tuple[str, str]:
    route = draw(st.sampled_from(sorted(BASE_BODIES)))
    body = json.dumps(BASE_BODIES[route])[:-1]
    for field in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3, unique=True)):
        body += f', "{field}": {draw(edge_values())}'
    return route, body + "}"


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=edge_requests())
def test_fuzzed_edge_bodies_never_get_a_5xx_and_keep_the_connection(client, request):
    route, text = request
    response = post_raw(client, route, text)
    assert response.status_code < 500, (route, text[:200], response.text[:300])
    assert response.headers.get("connection") != "close"
    if response.status_code >= 400:
        body = response.json()
        assert body.get("error") or body.get("type") == "error", body
    assert client.get("/health").status_code == 200  # the same keep-alive connection answers the next request
    assert math.isfinite(response.elapsed.total_seconds())


def test_tool_calls_to_tools_the_request_did_not_offer_are_dropped():
    offered = frozenset({"get_weather"})
    choice = {"message": {"content": None, "tool_calls": [{"function": {"name": "get_population"}}]},
              "finish_reason": "tool_calls"}  # fmt: skip
    assert not offered_calls_only(choice, offered)
    assert choice == {"message": {"content": ""}, "finish_reason": "stop"}
    calls = [{"function": {"name": "get_population"}}, {"function": {"name": "get_weather"}}]
    both = {"message": {"tool_calls": calls}, "finish_reason": "tool_calls"}
    assert offered_calls_only(both, offered)
    assert [c["function"]["name"] for c in both["message"]["tool_calls"]] == ["get_weather"]
    assert both["finish_reason"] == "tool_calls"
    # A stream: the name comes in the call's first delta, its arguments in later ones carrying only the index.
    dropped: set = set()
    first = {"delta": {"tool_calls": [{"index": 0, "function": {"name": "get_population", "arguments": ""}}]}}
    later = {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": 1}'}}]}}
    last = {"delta": {}, "finish_reason": "tool_calls"}
    for chunk in (first, later, last):
        assert not offered_calls_only(chunk, offered, dropped)
    assert "tool_calls" not in first["delta"] and "tool_calls" not in later["delta"] and last["finish_reason"] == "stop"


def test_a_typed_image_placeholder_is_plain_text():
    from dsinfer.chat.format import IMAGE_PLACEHOLDER, ChatFormat
    from dsinfer.models.tiny import default_model_dir
    from dsinfer.tokenizer import Tokenizer

    chat_format = ChatFormat(Tokenizer.from_dir(default_model_dir()), "v41", "m")
    typed = chat_format.prepare("chat", {"messages": [{"role": "user", "content": f"see {IMAGE_PLACEHOLDER}"}]})
    assert chat_format.image_token_id is not None and chat_format.image_token_id not in typed.prompt_ids
    assert typed.images == []
