"""``/v1/messages``: the Anthropic Messages API through deepseek-recipe, JSON and streaming events.

The library converts the body (system, messages with text / tool_use / tool_result blocks, tools,
tool_choice, thinking) and its Messages chunk generator produces the event stream (``message_start``,
``content_block_*``, ``message_delta``, ``message_stop``) and, accumulated, the message object. Same engine,
sampling, limits, cancellation and metrics as Chat Completions. Errors are Anthropic-shaped
(``{"type": "error", "error": {"type", "message"}}``), so the route reads its body itself rather than
through FastAPI's validation, whose errors are OpenAI-shaped.
"""

from __future__ import annotations

import json
import secrets

import deepseek_recipe as recipe
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from dsinfer.chat.format import ChatFormat
from dsinfer.chat.limits import LimitError
from dsinfer.chat.stream import ChoiceStream
from dsinfer.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestTimeoutError
from dsinfer.server.protocol import LibraryAPIFields, now
from dsinfer.server.response_stream import (
    ClientDisconnected,
    Run,
    event_api_answer,
)


class MessagesFields(LibraryAPIFields):
    max_tokens: int | None = None


def anthropic_error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status)


def register_messages_routes(app: FastAPI, engine: AsyncEngine, chat_format: ChatFormat, settings) -> None:
    from dsinfer.server.app import APIError, _check_model, _checked_prompt, prepare_off_loop

    @app.post("/v1/messages")
    async def messages(request: Request):
        try:
            return await _answer(request)
        except json.JSONDecodeError as exc:
            return anthropic_error(400, f"malformed JSON body: {exc}")
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first.get("loc", ()))
            return anthropic_error(400, f"{field}: {first.get('msg')}")
        except recipe.ConversionError as exc:
            message = json.loads(exc.body).get("error", {}).get("message", str(exc))
            return anthropic_error(exc.status_code, message)
        except HTTPException as exc:  # the body's size or shape (request_guard)
            return anthropic_error(
                exc.status_code,
                str(exc.detail),
                "request_too_large" if exc.status_code == 413 else "invalid_request_error",
            )
        except LimitError as exc:
            return anthropic_error(400, f"{exc.param}: {exc}" if exc.param and exc.param not in str(exc) else str(exc))
        except APIError as exc:
            kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
            return anthropic_error(exc.status, exc.message, kind)
        except QueueFullError as exc:
            return anthropic_error(429, str(exc), "rate_limit_error")
        except RequestTimeoutError as exc:
            return anthropic_error(408, str(exc), "timeout_error")
        except EngineDeadError as exc:
            return anthropic_error(503, str(exc), "api_error")
        except ClientDisconnected as exc:
            return anthropic_error(499, str(exc))
        except ValueError as exc:
            return anthropic_error(400, str(exc))

    async def _answer(request: Request):
        body = await request.json()
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        fields = MessagesFields.model_validate(body)
        if fields.model is None and settings.require_model:
            raise APIError(400, "model: Field required", param="model")  # Anthropic's words
        if fields.max_tokens is None:
            raise APIError(400, "max_tokens: Field required", param="max_tokens")
        _check_model(fields.model, settings, generation=True)
        prepared = await prepare_off_loop(chat_format, "messages", body, settings)
        params = prepared.sampling_params(settings.default_max_tokens, temperature=fields.temperature,
                                          top_k=fields.top_k, seed=fields.seed)  # fmt: skip
        prompt_ids = _checked_prompt(prepared.prompt_ids, settings, fields.max_tokens)
        message_id, model = "msg_" + secrets.token_hex(12), settings.served_model_name
        generator = recipe.MessagesRequest.chunk_generator(prepared.request, message_id, model)
        stream = engine.generate(prompt_ids, params, prepared.images)
        run = Run(stream, [ChoiceStream(chat_format, prepared, generator)], engine.finish)
        response = recipe.MessagesResponse(message_id, model, now(), len(prompt_ids), 0)
        return await event_api_answer(run, request, fields.stream, response, _error_event)


def _error_event(exc: Exception) -> dict:
    return {"type": "error", "error": {"type": "api_error", "message": str(exc)}}
