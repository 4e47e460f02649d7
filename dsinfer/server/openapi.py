"""The OpenAPI schema at /openapi.json, made to describe what the server really answers.

FastAPI's generated schema promises a 422 for bad bodies (we answer 400, OpenAI's status), says nothing about
the other errors, documents no body for routes that return plain dicts and knows neither the served model's
name nor this server's limits. This module rewrites it once: OpenAI-style error responses per route, the
event stream of streaming routes, the served model name as the only ``model`` value, and ``n`` /
``max_tokens`` bounded by the server's settings. A schema-based fuzzer (tests/test_openapi_fuzz.py) holds the
server to it.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

if TYPE_CHECKING:
    from dsinfer.server.app import ServerSettings

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
            },
        }
    },
}
COMPLETION_FIELDS = {
    "id": {"type": "string"},
    "object": {"type": "string"},
    "created": {"type": "integer"},
    "model": {"type": "string"},
    "choices": {"type": "array", "items": {"type": "object", "required": ["index", "finish_reason"]}},
}
COMPLETION_SCHEMA = {"type": "object", "required": [*COMPLETION_FIELDS, "usage"],
                     "properties": {**COMPLETION_FIELDS, "usage": {"type": "object"}}}  # fmt: skip
# Each server-sent event: its data is a JSON chunk, an error that ends the stream, or the final [DONE].
STREAM_EVENT_SCHEMA = {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
    {"type": "string", "enum": ["[DONE]"]},
    {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
        {"type": "object", "required": list(COMPLETION_FIELDS), "properties": {**COMPLETION_FIELDS,
            "choices": {"type": "array", "items": {"type": "object", "required": ["index"]}}}},
        {"$ref": "#/components/schemas/ErrorResponse"},
    ]}},
]}}}  # fmt: skip
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
# Routes whose body deepseek-recipe converts (OpenAI Responses, Anthropic Messages): the handler reads the raw
# JSON object, so the schema states only that, and every status a generation route can answer.
LIBRARY_ROUTES = ("/v1/responses", "/v1/messages")
ERROR_MEANINGS = {
    "400": "Invalid request: the message and param name the field",
    "401": "Missing or wrong API key (--api-key)",
    "404": "Unknown model",
    "408": "The request ran past --request-timeout",
    "429": "Too many waiting requests (--max-queue); retry after Retry-After seconds",
    "503": "The engine has stopped, or the server is shutting down",
}


def install_openapi(app: FastAPI, settings: ServerSettings, tokenizer_vocab_size: int) -> None:
    """Serve the corrected schema (built on first request, then cached like FastAPI's own)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = describe_server(schema, settings, tokenizer_vocab_size)
        return app.openapi_schema

    app.openapi = openapi


def describe_server(schema: dict[str, Any], settings: ServerSettings, tokenizer_vocab_size: int) -> dict[str, Any]:
    schema = copy.deepcopy(schema)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    components["ErrorResponse"] = ERROR_SCHEMA
    for name in ("ChatCompletionRequest", "CompletionRequest", "TokenizeRequest", "DetokenizeRequest"):
        if name in components:
            _bound_request(components[name], settings)
    if "CompletionRequest" in components:
        _bound_token_ids(components["CompletionRequest"]["properties"]["prompt"], settings.vocab_size, non_empty=True)
    if "DetokenizeRequest" in components:
        _bound_token_ids(components["DetokenizeRequest"]["properties"]["tokens"], tokenizer_vocab_size, non_empty=False)
    if "TokenizeRequest" in components:
        # Exactly one of the two, as the server checks.
        components["TokenizeRequest"]["oneOf"] = [
            {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
            {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
        ]
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            _describe_responses(path, operation, settings)
    if settings.api_key:
        schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"apiKey": []}]
        schema["paths"]["/health"]["get"]["security"] = []
    return schema


def _bound_request(body: dict[str, Any], settings: ServerSettings) -> None:
    """The served model's name is the only ``model``; ``n`` and completion lengths within the server's limits."""
    properties = body.get("properties", {})
    if "model" in properties:
        properties["model"] = {"anyOf": [{"type": "string", "enum": [settings.served_model_name]}, {"type": "null"}],
                               "title": "Model", "description": "The served model (GET /v1/models)"}  # fmt: skip
    if "n" in properties:
        properties["n"]["maximum"] = settings.max_n
    for name in ("max_tokens", "max_completion_tokens"):
        if name in properties:
            for option in properties[name].get("anyOf", []):
                if option.get("type") == "integer":
                    option["maximum"] = settings.max_model_len - 1
    ids = properties.get("stop_token_ids", {})
    for option in ids.get("anyOf", []):
        if option.get("type") == "array":
            option["items"]["minimum"] = 0


def _bound_token_ids(schema: dict[str, Any], vocab_size: int, non_empty: bool) -> None:
    """Token ids lie in [0, vocab_size); with ``non_empty`` lists are never empty (walks anyOf / items)."""
    for option in schema.get("anyOf", []):
        _bound_token_ids(option, vocab_size, non_empty)
    if schema.get("type") == "array":
        if non_empty:
            schema["minItems"] = 1
        _bound_token_ids(schema["items"], vocab_size, non_empty)
    elif schema.get("type") == "integer":
        schema["minimum"], schema["maximum"] = 0, vocab_size - 1


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}  # fmt: skip


def _describe_responses(path: str, operation: dict[str, Any], settings: ServerSettings) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    if path in LIBRARY_ROUTES:
        operation.setdefault("requestBody", {
            "required": True,
            "content": {"application/json": {"schema": {"type": "object", "description": "the API's request body"}}},
        })  # fmt: skip
    codes = []
    if "requestBody" in operation or operation.get("parameters"):
        codes.append("400")
    if settings.api_key and path != "/health":
        codes.append("401")
    generation = path in GENERATION_ROUTES or path in LIBRARY_ROUTES
    if generation or path.startswith("/v1/models/") or path in ("/tokenize", "/detokenize"):
        codes.append("404")
    if generation:
        codes += ["408", "429", "503"]
    if path == "/health":
        codes.append("503")
    for code in codes:
        responses[code] = _error(ERROR_MEANINGS[code])
    ok = responses.get("200")
    if ok is None:
        return
    if path in GENERATION_ROUTES:
        ok["description"] = "The completion as JSON, or with stream: true server-sent events ending in [DONE]"
        ok["content"] = {"application/json": {"schema": COMPLETION_SCHEMA},
                         "text/event-stream": {"schema": STREAM_EVENT_SCHEMA}}  # fmt: skip
    elif path in LIBRARY_ROUTES:
        ok["description"] = "The response as JSON, or with stream: true the API's server-sent events"
        ok["content"] = {"application/json": {"schema": {"type": "object"}},
                         "text/event-stream": {"schema": {"type": "string"}}}  # fmt: skip
    elif path == "/metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
