"""``--api-key`` guards every route but /health: the API, /metrics, /tokenize, /detokenize, the docs and the
schema, and unknown paths (a 401, not a 404 that would reveal which routes exist)."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import running_server

KEY = "secret"
CHAT = [{"role": "user", "content": "Hi"}]
BODIES = {
    "/v1/chat/completions": {"model": "tiny", "messages": CHAT, "max_tokens": 2},
    "/v1/completions": {"model": "tiny", "prompt": "Hi", "max_tokens": 2},
    "/tokenize": {"prompt": "Hi"},
    "/detokenize": {"tokens": [1, 2]},
    "/v1/responses": {"model": "tiny", "input": "Hi", "max_output_tokens": 2},
    "/v1/messages": {"model": "tiny", "messages": CHAT, "max_tokens": 2},
}


@pytest.fixture(scope="module")
def base(tiny_checkpoint):
    with running_server(tiny_checkpoint, api_key=KEY) as (url, _engine):
        yield url


def every_route(base: str) -> list[tuple[str, str]]:
    """(method, path) of every route: those the schema lists, plus the docs pages and the schema itself."""
    schema = httpx.get(f"{base}/openapi.json", headers={"authorization": f"Bearer {KEY}"}).json()
    routes = [(method.upper(), path.replace("{model_id}", "tiny")) for path, ops in schema["paths"].items()
              for method in ops]  # fmt: skip
    return routes + [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/docs/oauth2-redirect")]


def call(base: str, method: str, path: str, headers: dict) -> httpx.Response:
    return httpx.request(method, f"{base}{path}", json=BODIES.get(path), headers=headers, timeout=60)


def test_every_route_but_health_needs_the_key(base):
    routes = every_route(base)
    paths = {path for _, path in routes}
    for needed in ("/metrics", "/tokenize", "/detokenize", "/docs", "/openapi.json", "/v1/models", "/v1/models/tiny",
                   "/v1/chat/completions", "/v1/completions", "/health"):  # fmt: skip
        assert needed in paths, needed
    for method, path in routes + [("GET", "/no-such-route")]:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}, {"x-api-key": "wrong"}):
            response = call(base, method, path, headers)
            if path == "/health":
                assert response.status_code == 200, (path, headers)
                continue
            assert response.status_code == 401, (method, path, headers, response.status_code)
            assert response.json()["error"]["type"] == "authentication_error"
        for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
            response = call(base, method, path, headers)
            expected = 404 if path == "/no-such-route" else 200
            assert response.status_code == expected, (method, path, headers, response.text[:200])


def test_openai_client_with_and_without_the_key(base):
    denied = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        denied.models.list()
    allowed = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
    assert allowed.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2).choices
    assert allowed.models.retrieve("tiny").id == "tiny"


def test_either_header_carrying_the_key_authenticates(base):
    """A client may carry a stale key in the other header (an OpenAI client behind an Anthropic gateway)."""
    for headers in ({"x-api-key": "wrong", "authorization": f"Bearer {KEY}"},
                    {"x-api-key": KEY, "authorization": "Bearer wrong"}):  # fmt: skip
        assert call(base, "POST", "/tokenize", headers).status_code == 200, headers
    both_wrong = {"x-api-key": "wrong", "authorization": "Bearer wrong"}
    assert call(base, "POST", "/tokenize", both_wrong).status_code == 401
    assert httpx.head(f"{base}/health").status_code == 200  # open, like GET
