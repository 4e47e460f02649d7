"""The HTTP API (FastAPI): chat and text completions, Responses, Messages, models, health, metrics, tokenize.

Handlers validate, encode the prompt, hand the request to the engine thread (:class:`AsyncEngine`) and turn
its outputs into JSON or server-sent events. Chat Completions, Responses and Anthropic Messages go through
deepseek-recipe (``chat_format`` converts and encodes, ``response_stream`` parses) and live in their own
modules. Every error is OpenAI-style JSON (Anthropic-style on ``/v1/messages``) with a 4xx status; the engine
keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass

import deepseek_recipe as recipe
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsinfer.config_vision import VisionConfig
from dsinfer.engine.outputs import RequestOutput
from dsinfer.sampling_params import SamplingParams
from dsinfer.server.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestTimeoutError
from dsinfer.server.chat_format import ChatFormat, Variant
from dsinfer.server.images import ImageLimits, ImageReader
from dsinfer.server.protocol import (
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    Usage,
    completion_id,
    error_body,
    now,
)
from dsinfer.server.response_stream import ClientDisconnected
from dsinfer.tokenizer import Tokenizer


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_model_len: int = 4096
    default_max_tokens: int = 256
    chat_variant: Variant = "v4"  # the prompt spelling the checkpoint was trained on ("v41" for DeepSeek-V4.1)
    vision: VisionConfig | None = None  # the checkpoint's vision tower; None: image parts are refused
    image_limits: ImageLimits | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="dsinfer", version="0.1.0")
    app.state.engine, app.state.tokenizer, app.state.settings = engine, tokenizer, settings
    reader = ImageReader(settings.vision, settings.image_limits) if settings.vision is not None else None
    chat_format = ChatFormat(tokenizer, settings.chat_variant, settings.served_model_name, image_reader=reader)
    app.state.chat_format = chat_format
    _install_error_handlers(app)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if settings.api_key and request.url.path.startswith("/v1"):
            supplied = request.headers.get("authorization", "")
            if not secrets.compare_digest(supplied.encode(), f"Bearer {settings.api_key}".encode()):
                return JSONResponse(error_body("invalid or missing API key", "authentication_error"), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse(error_body("engine is not running", "server_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {"id": settings.served_model_name, "object": "model", "created": now(), "owned_by": "dsinfer",
                "max_model_len": settings.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        _check_model(body.model, settings)
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, allow_special=False)
            if body.add_special_tokens and tokenizer.bos_id is not None:
                ids = [tokenizer.bos_id, *ids]
        else:  # a chat: exactly the prompt /v1/chat/completions would run
            chat = {k: v for k, v in (await request.json()).items()
                    if k not in ("prompt", "add_special_tokens", "add_generation_prompt", "stream")}  # fmt: skip
            ids = chat_format.prepare("chat", chat).prompt_ids
            if not body.add_generation_prompt:
                ids = chat_format.without_generation_prompt(ids)
        return {"tokens": ids, "count": len(ids), "max_model_len": settings.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_model(body.model, settings)
        try:
            return {"prompt": tokenizer.decode(body.tokens)}
        except ValueError as exc:
            raise APIError(400, str(exc), param="tokens") from None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, settings)
        prompts = _completion_prompts(body.prompt, tokenizer)
        if len(prompts) != 1:
            raise APIError(400, "batched prompts are not supported; send one prompt per request", param="prompt")
        params = _params(body, body.max_tokens, body.logprobs, settings)
        prompt_ids = _checked_prompt(prompts[0], settings)
        stream = engine.generate(prompt_ids, params)
        if body.stream:
            return _sse(_completion_chunks(stream, body, params, settings, tokenizer))
        final = await _last_output(stream, request)
        return _completion_response(final, body, settings, tokenizer)

    from dsinfer.server.chat_api import register_chat_routes
    from dsinfer.server.messages_api import register_messages_routes
    from dsinfer.server.responses_api import register_responses_routes

    register_chat_routes(app, engine, chat_format, settings)
    register_responses_routes(app, engine, chat_format, settings)
    register_messages_routes(app, engine, chat_format, settings)
    return app


# ---- errors ------------------------------------------------------------------------------------
def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.param), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
        location = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"malformed JSON body: {first.get('msg')}"), status_code=400)
        param = ".".join(location) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(recipe.ConversionError)
    async def conversion_error(_request, exc: recipe.ConversionError):
        return JSONResponse(json.loads(exc.body), status_code=exc.status_code)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_request, exc: ClientDisconnected):
        return JSONResponse(error_body(str(exc)), status_code=499)

    @app.exception_handler(ValueError)
    async def value_error(_request, exc: ValueError):
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(QueueFullError)
    async def queue_full(_request, exc: QueueFullError):
        return JSONResponse(error_body(str(exc), "rate_limit_error"), status_code=429, headers={"Retry-After": "1"})

    @app.exception_handler(RequestTimeoutError)
    async def timeout(_request, exc: RequestTimeoutError):
        return JSONResponse(error_body(str(exc), "timeout_error"), status_code=408)

    @app.exception_handler(EngineDeadError)
    async def dead(_request, exc: EngineDeadError):
        return JSONResponse(error_body(str(exc), "server_error"), status_code=503)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code)


def _check_model(name: str | None, settings: ServerSettings) -> None:
    if name is not None and name != settings.served_model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {settings.served_model_name!r}",
                       "not_found_error", "model")  # fmt: skip


def _params(body, max_tokens: int | None, logprobs: int | None, settings: ServerSettings) -> SamplingParams:
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    return body.sampling_params(max_tokens, logprobs, settings.default_max_tokens)


def _checked_prompt(prompt_ids: list[int], settings: ServerSettings) -> list[int]:
    if len(prompt_ids) >= settings.max_model_len:
        raise APIError(
            400,
            f"the prompt has {len(prompt_ids)} tokens; this model's maximum context length is "
            f"{settings.max_model_len} tokens, including the completion",
            param="messages",
        )
    return prompt_ids


def _completion_prompts(prompt, tokenizer: Tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [_text_prompt(prompt, tokenizer)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [_text_prompt(p, tokenizer) if isinstance(p, str) else list(p) for p in prompt]


def _text_prompt(text: str, tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode(text, allow_special=False)
    return [tokenizer.bos_id, *ids] if tokenizer.bos_id is not None else ids


# ---- running requests --------------------------------------------------------------------------
async def _last_output(stream: AsyncIterator[RequestOutput], request: Request) -> RequestOutput:
    """Drain a non-streaming request; a client that disconnects meanwhile aborts it."""

    async def drain() -> RequestOutput:
        final = None
        async for output in stream:
            final = output
        return final

    task = asyncio.ensure_future(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.1)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                await stream.aclose()
                raise APIError(499, "client disconnected")
        return task.result()
    finally:
        if not task.done():
            task.cancel()


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except (ValueError, RequestTimeoutError, EngineDeadError) as exc:
            yield f"data: {json.dumps(error_body(str(exc)))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _usage(output: RequestOutput) -> dict:
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    prompt_tokens = len(output.prompt_token_ids)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens).model_dump()  # fmt: skip


def _hold_back(params: SamplingParams) -> int:
    """Characters kept unsent while streaming, so a stop string that completes later can still be cut."""
    return max((len(s) for s in params.stop), default=1) - 1


def _visible_text(text: str, finished: bool, hold: int) -> str:
    """Text safe to send now: no half-decoded character, nothing a stop string might still remove."""
    if finished:
        return text
    text = text.rstrip("\ufffd")
    return text[: len(text) - hold] if hold else text


def _token_logprobs(tokenizer: Tokenizer, ids: list[int], logprobs, tops) -> list[dict]:
    entries = []
    for position, token in enumerate(ids):
        text = tokenizer.decode([token])
        top = [{"token": tokenizer.decode([t]), "logprob": lp, "bytes": list(tokenizer.decode([t]).encode())}
               for t, lp in (tops[position] if tops else [])]  # fmt: skip
        entries.append(
            {"token": text, "logprob": logprobs[position], "bytes": list(text.encode()), "top_logprobs": top}
        )
    return entries


# ---- text completions --------------------------------------------------------------------------
def _completion_response(final: RequestOutput, body: CompletionRequest, settings, tokenizer) -> dict:
    choices = []
    for c in final.outputs:
        logprobs = None
        if c.logprobs is not None:
            logprobs = {
                "tokens": [tokenizer.decode([t]) for t in c.token_ids],
                "token_logprobs": c.logprobs,
                "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in top} for top in (c.top_logprobs or [])],
            }
        text = (tokenizer.decode(final.prompt_token_ids) if body.echo else "") + c.text
        choices.append({"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason})
    return {"id": completion_id("cmpl"), "object": "text_completion", "created": now(),
            "model": settings.served_model_name, "choices": choices, "usage": _usage(final)}  # fmt: skip


async def _completion_chunks(stream, body: CompletionRequest, params: SamplingParams, settings, tokenizer):
    request_id, created, sent = completion_id("cmpl"), now(), {}
    hold = _hold_back(params)
    final = None
    async for output in stream:
        final = output
        for c in output.outputs:
            done = c.finish_reason is not None
            visible = _visible_text(c.text, done, hold)
            delta = visible[len(sent.get(c.index, "")) :]
            if not delta and not done:
                continue
            sent[c.index] = visible
            choice = {"index": c.index, "text": delta, "logprobs": None, "finish_reason": c.finish_reason}
            yield {"id": request_id, "object": "text_completion", "created": created,
                   "model": settings.served_model_name, "choices": [choice]}  # fmt: skip
    if body.stream_options and body.stream_options.include_usage and final is not None:
        yield {"id": request_id, "object": "text_completion", "created": created, "model": settings.served_model_name,
               "choices": [], "usage": _usage(final)}  # fmt: skip
