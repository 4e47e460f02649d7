"""``/v1/chat/completions``: OpenAI Chat Completions through deepseek-recipe, JSON and server-sent events.

The library converts the body, renders the prompt and parses the output into its Chat Completions chunks.
What is ours: the sampling fields vLLM and SGLang add (top_k, min_p, penalties, min_tokens...), ``n``
choices (one stream processor each, their chunks re-indexed), ``reasoning`` next to ``reasoning_content``
(vLLM's newer name for the same text), and usage in its own last chunk when ``stream_options.include_usage``
asks for it, as OpenAI sends it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import deepseek_recipe as recipe
from fastapi import FastAPI, Request
from fastapi.responses import Response

from dsinfer.server.async_engine import AsyncEngine
from dsinfer.server.chat_format import ChatFormat
from dsinfer.server.limits import check_n
from dsinfer.server.protocol import ChatCompletionRequest, completion_id, now
from dsinfer.server.response_stream import ChoiceStream, Run, collect


def register_chat_routes(app: FastAPI, engine: AsyncEngine, chat_format: ChatFormat, settings) -> None:
    from dsinfer.server.app import _check_model, _params, _sse, _token_logprobs, prepare_off_loop

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
        run = Run(engine.generate(prompt_ids, params, prepared.images), choices)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_chunks(run, include_usage, request_id, model, created))
        items = await collect(run, request)
        responses = [recipe.ChatCompletionResponse(request_id, model, created, len(prompt_ids), 0) for _ in choices]
        for index, events in items:
            for event in events:
                responses[index].accumulate(event)
        merged = _merged(responses, run)
        if logprobs is not None and run.final is not None:  # the engine's logprobs of every generated token
            completions = {completion.index: completion for completion in run.final.outputs}
            for choice in merged["choices"]:
                completion = completions.get(choice["index"])
                if completion is not None and completion.logprobs is not None:
                    content = _token_logprobs(chat_format.tokenizer, completion.token_ids, completion.logprobs,
                                              completion.top_logprobs)  # fmt: skip
                    choice["logprobs"] = {"content": content}
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


async def _chunks(run: Run, include_usage: bool, request_id: str, model: str, created: int):
    """The stream's chunks: dicts, or the library's JSON text where it needs no edit (most answer tokens)."""
    dated = f',"created":{created},'  # the library dates its chunks itself; ours must win where they differ
    async for index, events in run:
        for event in events:
            text = event.to_json()
            # Quotes inside JSON strings are escaped, so these keys cannot be matched inside generated text.
            if index == 0 and dated in text and '"usage"' not in text and '"reasoning_content"' not in text:
                yield text
                continue
            chunk = json.loads(text)
            chunk.pop("usage", None)
            chunk["created"] = created
            for choice in chunk.get("choices", []):
                choice["index"] = index
                _with_reasoning_alias(choice.get("delta") or {})
            yield chunk
    if include_usage:
        yield {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [], "usage": run.usage()}  # fmt: skip
