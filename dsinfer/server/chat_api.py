"""``/v1/chat/completions``: OpenAI Chat Completions through deepseek-recipe, JSON and server-sent events.

The library converts the body, renders the prompt and parses the output into its Chat Completions chunks.
What is ours: the sampling fields vLLM and SGLang add (top_k, min_p, penalties, min_tokens...), ``n``
choices (one stream processor each, their chunks re-indexed), ``reasoning`` next to ``reasoning_content``
(vLLM's newer name for the same text), and usage in its own last chunk when ``stream_options.include_usage``
asks for it, as OpenAI sends it. Logprobs come from the library too, streamed or not, so both carry the same
entries: each chunk those of the tokens its delta shows, answer tokens under ``content`` and reasoning tokens
under ``reasoning_content`` (DeepSeek's API), control tokens (end of sentence) in neither.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import deepseek_recipe as recipe
from fastapi import FastAPI, Request
from fastapi.responses import Response

from dsinfer.chat.format import ChatFormat
from dsinfer.chat.limits import check_n
from dsinfer.chat.stream import ChoiceStream
from dsinfer.server.async_engine import AsyncEngine
from dsinfer.server.protocol import ChatCompletionRequest, completion_id, now
from dsinfer.server.response_stream import Run, collect


def register_chat_routes(app: FastAPI, engine: AsyncEngine, chat_format: ChatFormat, settings) -> None:
    from dsinfer.server.app import _check_model, _params, _sse, prepare_off_loop

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(body.model, settings, generation=True)
        check_n(body.n, 1, settings.max_n)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        length_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        prepared = await prepare_off_loop(chat_format, "chat", await request.json(), settings)
        prompt_ids = prepared.prompt_ids
        params = _params(body, prompt_ids, "messages", length_field, max_tokens, logprobs, settings)
        # Stop sequences end the answer, not the reasoning: the stream processor applies them, and it turns the
        # token ids into text itself, so the engine keeps none.
        params = replace(params, stop=[], structured_output=prepared.structured_output, detokenize=False)
        request_id, model, created = completion_id("chatcmpl"), settings.served_model_name, now()
        choices = [
            ChoiceStream(chat_format, prepared, recipe.ChatCompletionRequest.chunk_generator(
                prepared.request, request_id, model))
            for _ in range(body.n)
        ]  # fmt: skip
        run = Run(engine.generate(prompt_ids, params, prepared.images), choices, engine.finish)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_chunks(run, include_usage, request_id, model, created, _offered_tools(prepared)))
        items = await collect(run, request)
        responses = [recipe.ChatCompletionResponse(request_id, model, created, len(prompt_ids), 0) for _ in choices]
        for index, events in items:
            for event in events:
                responses[index].accumulate(event)
        merged = _merged(responses, run)
        offered = _offered_tools(prepared)
        for choice in merged["choices"]:
            offered_calls_only(choice, offered)
        return Response(json.dumps(merged, ensure_ascii=False), media_type="application/json")


def _with_reasoning_alias(fields: dict[str, Any]) -> None:
    if fields.get("reasoning_content") is not None:
        fields["reasoning"] = fields["reasoning_content"]


def _merged(responses: list[recipe.ChatCompletionResponse], run: Run) -> dict[str, Any]:
    """One response of ``n`` choices from the library's one-choice responses, usage as the engine counted."""
    documents = [json.loads(response.to_json()) for response in responses]
    choices = []
    for index, document in enumerate(documents):
        for choice in document.get("choices", []):
            choice["index"] = index
            message = choice.get("message") or {}
            _with_reasoning_alias(message)
            if message.get("tool_calls") and message.get("content") == "":
                message["content"] = None  # as OpenAI sends a message that only calls tools
            choices.append(choice)
    merged = {**documents[0], "choices": choices}
    merged["usage"] = run.usage()
    return merged


def _offered_tools(prepared) -> frozenset[str]:
    return frozenset(tool.name for tool in prepared.request.conversation.tools)


def offered_calls_only(
    choice: dict[str, Any], offered: frozenset[str], dropped: set | None = None, calls_sent: bool = False
) -> bool:
    """Drop from a choice (a message, or a stream chunk's delta) the tool calls to functions the request did not
    offer, so a reply never says ``tool_calls`` for a tool the client does not have: without a call left (and
    none sent earlier in the stream, ``calls_sent``) the choice finishes with ``stop``. ``dropped`` carries a
    stream's dropped call indices across its chunks. Returns whether the choice still carries a call."""
    fields = choice.get("message") or choice.get("delta") or {}
    calls = fields.get("tool_calls") or []
    dropped = set() if dropped is None else dropped
    for position, call in enumerate(calls):
        name = (call.get("function") or {}).get("name")
        if name is not None and name not in offered:
            dropped.add(call.get("index", position))
    kept = [call for position, call in enumerate(calls) if call.get("index", position) not in dropped]
    if calls and kept:
        fields["tool_calls"] = kept
    elif calls:
        fields.pop("tool_calls")
        if "message" in choice and fields.get("content") is None:
            fields["content"] = ""
    if choice.get("finish_reason") == "tool_calls" and not (kept or calls_sent):
        choice["finish_reason"] = "stop"
    return bool(kept)


async def _chunks(run: Run, include_usage: bool, request_id: str, model: str, created: int,
                  offered: frozenset[str] = frozenset()):  # fmt: skip
    """The stream's chunks: dicts, or the library's JSON text where it needs no edit (most answer tokens)."""
    dated = f',"created":{created},'  # the library dates its chunks itself; ours must win where they differ
    dropped: dict[int, set] = {}  # per choice: indices of calls to tools the request did not offer
    kept: set[int] = set()  # choices that sent a call to an offered tool
    async for index, events in run:
        for event in events:
            text = event.to_json()
            # Quotes inside JSON strings are escaped, so these keys cannot be matched inside generated text.
            if index == 0 and dated in text and '"usage"' not in text and '"reasoning_content"' not in text \
                    and '"tool_calls"' not in text:  # fmt: skip
                yield text
                continue
            chunk = json.loads(text)
            chunk.pop("usage", None)
            chunk["created"] = created
            for choice in chunk.get("choices", []):
                choice["index"] = index
                _with_reasoning_alias(choice.get("delta") or {})
                if (choice.get("delta") or {}).get("tool_calls") or choice.get("finish_reason") == "tool_calls":
                    if offered_calls_only(choice, offered, dropped.setdefault(index, set()), index in kept):
                        kept.add(index)
            yield chunk
    if include_usage:
        yield {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [], "usage": run.usage()}  # fmt: skip
