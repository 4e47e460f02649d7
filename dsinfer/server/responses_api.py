"""``/v1/responses``: the OpenAI Responses API through deepseek-recipe, JSON and server-sent events.

The library converts the body (input items, instructions, tools, reasoning effort, text format), and its
Responses chunk generator turns the output into the API's events (``response.created`` ...
``response.completed``) and, accumulated, into the response object. The request runs on the same engine,
sampling, limits, cancellation and metrics as Chat Completions.
"""

from __future__ import annotations

import secrets

import deepseek_recipe as recipe
from fastapi import FastAPI, Request

from dsinfer.chat.format import ChatFormat
from dsinfer.chat.stream import ChoiceStream
from dsinfer.server.async_engine import AsyncEngine
from dsinfer.server.protocol import LibraryAPIFields, now
from dsinfer.server.response_stream import (
    Run,
    event_api_answer,
)


class ResponsesFields(LibraryAPIFields):
    max_output_tokens: int | None = None
    top_logprobs: int | None = None


def register_responses_routes(app: FastAPI, engine: AsyncEngine, chat_format: ChatFormat, settings) -> None:
    from dsinfer.server.app import _check_model, _checked_prompt, prepare_off_loop

    @app.post("/v1/responses")
    async def responses(fields: ResponsesFields, request: Request):
        _check_model(fields.model, settings, generation=True)
        prepared = await prepare_off_loop(chat_format, "responses", await request.json(), settings)
        params = prepared.sampling_params(settings.default_max_tokens, temperature=fields.temperature,
                                          top_k=fields.top_k, seed=fields.seed)  # fmt: skip
        prompt_ids = _checked_prompt(prepared.prompt_ids, settings, fields.max_output_tokens, "max_output_tokens",
                                     "input")  # fmt: skip
        response_id, model = "resp_" + secrets.token_hex(12), settings.served_model_name
        generator = recipe.ResponsesRequest.chunk_generator(prepared.request, response_id, model)
        if prepared.echo is not None:
            generator = generator.with_echo(prepared.echo)
        stream = engine.generate(prompt_ids, params, prepared.images)
        run = Run(stream, [ChoiceStream(chat_format, prepared, generator)], engine.finish)
        response = recipe.ResponsesResponse(response_id, model, now(), len(prompt_ids), 0)
        return await event_api_answer(run, request, fields.stream, response, _error_event)


def _error_event(exc: Exception) -> dict:
    return {"type": "error", "code": type(exc).__name__, "message": str(exc), "param": None}
