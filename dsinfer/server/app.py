"""The HTTP API (FastAPI): chat and text completions, Responses, Messages, models, health, metrics, tokenize.

Handlers validate, encode the prompt, hand the request to the engine thread (:class:`AsyncEngine`) and turn
its outputs into JSON or server-sent events. Chat Completions, Responses and Anthropic Messages go through
deepseek-recipe (:mod:`dsinfer.chat.format` converts and encodes, :mod:`dsinfer.chat.stream` parses) and live in
their own modules. Every error is OpenAI-style JSON (Anthropic-style on ``/v1/messages``) with a 4xx status; the engine
keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import deepseek_recipe as recipe
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dsinfer.chat.format import ChatFormat, Variant
from dsinfer.chat.image_reader import ImageLimits, ImageReader
from dsinfer.chat.limits import (
    DEFAULT_MAX_N,
    PROMPT_FIELDS,
    SCHEMA_FIELDS,
    LimitError,
    check_n,
    check_text_fits,
    completion_budget,
    text_chars,
)
from dsinfer.config.vision import VisionConfig
from dsinfer.engine.outputs import RequestOutput
from dsinfer.sampling_params import SamplingParams
from dsinfer.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestTimeoutError,
    ServerShuttingDownError,
)
from dsinfer.server.auth import APIKeyMiddleware
from dsinfer.server.disconnect import unless_disconnected
from dsinfer.server.guided import GUIDED_FIELDS, check_schema, guided_output
from dsinfer.server.openapi import install_openapi
from dsinfer.server.protocol import (
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    Usage,
    completion_id,
    error_body,
    now,
)
from dsinfer.server.request_guard import DEFAULT_MAX_REQUEST_BYTES, GuardedRoute, RequestSizeLimit
from dsinfer.server.response_stream import ClientDisconnected, sse_frame
from dsinfer.server.streams import last_items, merged
from dsinfer.tokenizer import Tokenizer


@dataclass
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_model_len: int = 4096
    default_max_tokens: int = 256
    chat_variant: Variant = "v4"  # the prompt spelling the checkpoint was trained on ("v41" for DeepSeek-V4.1)
    max_n: int = DEFAULT_MAX_N  # completions per request (n, times the prompts of a batched completion)
    vocab_size: int = 2**31  # token ids a prompt may hold: [0, vocab_size)
    vision: VisionConfig | None = None  # the checkpoint's vision tower; None: image parts are refused
    image_limits: ImageLimits | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger body is a 413 before it is parsed
    # OpenAI and Anthropic answer a generation request without ``model`` with a 400; False serves it with the
    # served model, as vLLM does (/tokenize and /detokenize never need it).
    require_model: bool = True


class APIError(Exception):
    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code=None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, settings: ServerSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.attach()  # an engine in other processes: its pipes are read in this event loop from now on
        yield

    app = FastAPI(title="dsinfer", version="0.1.0", lifespan=lifespan)
    app.router.route_class = GuardedRoute  # JSON bodies parsed off the event loop, their shape checked
    app.state.engine, app.state.tokenizer, app.state.settings = engine, tokenizer, settings
    reader = ImageReader(settings.vision, settings.image_limits) if settings.vision is not None else None
    chat_format = ChatFormat(tokenizer, settings.chat_variant, settings.served_model_name, image_reader=reader)
    app.state.chat_format = chat_format
    _install_error_handlers(app)
    app.add_middleware(RequestSizeLimit, max_bytes=settings.max_request_bytes)
    if settings.api_key:  # outermost: a request without the key is refused before its body is read
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    install_openapi(app, settings, tokenizer.vocab_size)
    _register_status_routes(app, engine, settings)
    _register_token_routes(app, tokenizer, chat_format, settings)
    _register_completion_routes(app, engine, tokenizer, settings)

    from dsinfer.server.chat_api import register_chat_routes
    from dsinfer.server.messages_api import register_messages_routes
    from dsinfer.server.responses_api import register_responses_routes

    register_chat_routes(app, engine, chat_format, settings)
    register_responses_routes(app, engine, chat_format, settings)
    register_messages_routes(app, engine, chat_format, settings)
    return app


def _register_status_routes(app: FastAPI, engine: AsyncEngine, settings: ServerSettings) -> None:
    """Health (GET and HEAD), Prometheus metrics and the model list."""

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse(error_body("engine is not running", "server_error"), status_code=503)
        return {"status": "ok"}

    @app.head("/health", include_in_schema=False)
    async def health_head():
        return Response(status_code=200 if engine.alive else 503)  # load balancers probe with HEAD too

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": settings.served_model_name, "object": "model", "created": now(), "owned_by": "dsinfer",
                "max_model_len": settings.max_model_len}  # fmt: skip

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(model_id, settings)
        return model_card()


def _register_token_routes(
    app: FastAPI, tokenizer: Tokenizer, chat_format: ChatFormat, settings: ServerSettings
) -> None:
    """``/tokenize`` (a prompt, or a chat as /v1/chat/completions renders it) and ``/detokenize``."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        _check_model(body.model, settings)
        if body.prompt is not None:
            check_text_fits(len(body.prompt), settings.max_model_len, tokenizer.max_token_chars, "prompt")
            ids = await run_in_threadpool(tokenizer.encode, body.prompt, allow_special=False)
            if body.add_special_tokens and tokenizer.bos_id is not None:
                ids = [tokenizer.bos_id, *ids]
        else:  # a chat: exactly the prompt /v1/chat/completions would run
            chat = {k: v for k, v in (await request.json()).items()
                    if k not in ("prompt", "add_special_tokens", "add_generation_prompt", "stream")}  # fmt: skip
            ids = (await prepare_off_loop(chat_format, "chat", chat, settings)).prompt_ids
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


def _register_completion_routes(
    app: FastAPI, engine: AsyncEngine, tokenizer: Tokenizer, settings: ServerSettings
) -> None:
    """``/v1/completions``: raw prompts (text or token ids), JSON or server-sent events."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, settings, generation=True)
        texts = [body.prompt] if isinstance(body.prompt, str) else [p for p in body.prompt if isinstance(p, str)]
        check_text_fits(max(map(len, texts), default=0), settings.max_model_len, tokenizer.max_token_chars, "prompt")
        prompts = await run_in_threadpool(_completion_prompts, body.prompt, tokenizer, settings.vocab_size)
        guided = guided_output(await request.json(), None, settings.max_model_len)
        check_n(body.n, len(prompts), settings.max_n)
        params = [_params(body, p, "prompt", "max_tokens", body.max_tokens, body.logprobs, settings) for p in prompts]
        if guided is not None:
            params = [replace(sp, structured_output=guided) for sp in params]
        streams = [engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
        if body.stream:
            return _sse(_completion_chunks(merged(streams), body, params[0], settings, tokenizer))
        finals = await unless_disconnected(last_items(streams), request)
        return _completion_response(finals, body, settings, tokenizer)


# ---- errors ------------------------------------------------------------------------------------
def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(LimitError)
    async def limit_error(_request, exc: LimitError):
        return JSONResponse(error_body(str(exc), param=exc.param, code=exc.code), status_code=400)

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_request, _exc: ClientDisconnect):
        return Response(status_code=499)  # nobody reads it; the request was aborted

    @app.exception_handler(ServerShuttingDownError)
    async def shutting_down(_request, exc: ServerShuttingDownError):
        return JSONResponse(error_body(str(exc), "server_error"), status_code=503)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, exc: RequestValidationError):
        # Of a union's errors, the member that matched deepest explains best ([[1, 1.5]]: prompt.0.1, not "str").
        errors = exc.errors() or [{"msg": "invalid request", "loc": ()}]
        first = max(errors, key=lambda error: len(error.get("loc", ())))
        location = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_union_tag(p)]
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"malformed JSON body: {first.get('msg')}", param="body"), status_code=400)
        param = ".".join(location) or ("body" if first.get("type") == "missing" else None)
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(recipe.ConversionError)
    async def conversion_error(request: Request, exc: recipe.ConversionError):
        return JSONResponse(conversion_error_body(exc, request.url.path), status_code=exc.status_code)

    @app.exception_handler(ClientDisconnected)
    async def client_left(_request, exc: ClientDisconnected):
        return JSONResponse(error_body(str(exc)), status_code=499)

    @app.exception_handler(ValueError)
    async def value_error(_request, exc: ValueError):
        named = _FIELD_FIRST.match(str(exc))  # SamplingParams' messages start with the field they reject
        return JSONResponse(error_body(str(exc), param=named.group(1) if named else None), status_code=400)

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
        body = error_body(str(exc.detail), param=getattr(exc, "param", "body" if exc.status_code == 413 else None))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


_FIELD_FIRST = re.compile(r"^([a-z_]+) must ")
# deepseek-recipe's range errors ("Invalid seed value, ...", "Stop string array too long: 17") name no param.
_RECIPE_FIELDS = ((re.compile(r"^Invalid (\w+) value"), None), (re.compile(r"^Stop string array"), "stop"),
                  (re.compile(r"^Invalid json schema"), "schema"))  # fmt: skip
_ROUTE_PROTOCOLS = {"/v1/responses": "responses", "/v1/messages": "messages"}


def conversion_error_body(exc: recipe.ConversionError, path: str) -> dict:
    """The library's OpenAI-style error body, its ``param`` filled in where the message names the field (in the
    spelling of the route at ``path``: the Responses API calls max_tokens ``max_output_tokens``)."""
    body = json.loads(exc.body)
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("param") is None:
        message = str(error.get("message", ""))
        for pattern, field in _RECIPE_FIELDS:
            found = pattern.match(message)
            if found:
                field = field or found.group(1)
                if field == "schema":
                    field = SCHEMA_FIELDS[_ROUTE_PROTOCOLS.get(path, "chat")]
                error["param"] = "max_output_tokens" if path == "/v1/responses" and field == "max_tokens" else field
                break
    return body


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _is_union_tag(part) -> bool:
    """pydantic names the union member an error came from (``str``, ``list[int]``, a model class) in its loc."""
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part or part[:1].isupper())


def _check_model(name: str | None, settings: ServerSettings, *, generation: bool = False) -> None:
    """A ``model`` other than the served one is a 404; none at all is a 400 on the generation routes, as OpenAI
    and Anthropic answer (unless the server was started to serve such requests, as vLLM does)."""
    if name is None:
        if generation and settings.require_model:
            raise APIError(400, "you must provide a model parameter", param="model")
        return
    if name != settings.served_model_name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {settings.served_model_name!r}",
                       "invalid_request_error", "model", "model_not_found")  # fmt: skip


def _params(body, prompt_ids: list[int], prompt_field: str, length_field: str, max_tokens: int | None,
            logprobs: int | None, settings: ServerSettings) -> SamplingParams:  # fmt: skip
    """SamplingParams for one prompt, its completion length checked against the context (400 naming the field)."""
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"{length_field} must be at least 1, got {max_tokens}", param=length_field)
    budget = completion_budget(len(prompt_ids), max_tokens, settings.max_model_len, settings.default_max_tokens,
                               prompt_field, length_field)  # fmt: skip
    return body.sampling_params(budget, logprobs, settings.default_max_tokens)


def _checked_prompt(prompt_ids: list[int], settings: ServerSettings, max_tokens: int | None = None,
                    length_field: str = "max_tokens", prompt_field: str = "messages") -> list[int]:  # fmt: skip
    """A chat prompt that leaves room for the completion the request asked for (Responses and Messages), with
    the same 400 naming the field as chat and text completions give."""
    completion_budget(len(prompt_ids), max_tokens, settings.max_model_len, settings.default_max_tokens,
                      prompt_field, length_field)  # fmt: skip
    return prompt_ids


async def prepare_off_loop(chat_format: ChatFormat, protocol, body, settings: ServerSettings):
    """Convert and encode a chat-style body in a worker thread (a long prompt never stalls /health), after
    refusing, without tokenizing, one whose text cannot fit the context however it is split."""
    fields = PROMPT_FIELDS[protocol]
    chars = sum(text_chars(body.get(name)) for name in fields) if isinstance(body, dict) else 0
    check_text_fits(chars, settings.max_model_len, chat_format.tokenizer.max_token_chars, fields[0])
    try:
        prepared = await run_in_threadpool(chat_format.prepare, protocol, body)
    except ValueError as exc:
        if str(exc).startswith("structured_output"):  # the output schema did not compile: name where it is
            raise LimitError(str(exc), SCHEMA_FIELDS[protocol]) from None
        raise
    structured = prepared.structured_output
    if structured is not None and structured.kind == "json_schema":
        schema = json.loads(structured.spec) if isinstance(structured.spec, str) else structured.spec
        check_schema(schema, SCHEMA_FIELDS[protocol], settings.max_model_len)
    start_after = chat_format.think_end_id if prepared.thinking else None
    guided = guided_output(body, start_after, settings.max_model_len)
    if guided is not None:
        if structured is not None:
            raise LimitError("give one structured-output constraint per request (tool_choice or response_format "
                             "already constrains this one)", next(f for f in GUIDED_FIELDS if body.get(f)))  # fmt: skip
        prepared.structured_output = guided
    return prepared


def _completion_prompts(prompt, tokenizer: Tokenizer, vocab_size: int) -> list[list[int]]:
    """The prompt ids of every prompt: one text, one token list, a list of texts or a list of token lists."""
    if isinstance(prompt, str):
        return [_text_prompt(prompt, tokenizer)]
    if prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [_text_prompt(p, tokenizer) if isinstance(p, str) else list(p) for p in prompt]
    for ids in prompts:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}", param="prompt")
    return prompts


def _text_prompt(text: str, tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode(text, allow_special=False)
    return [tokenizer.bos_id, *ids] if tokenizer.bos_id is not None else ids


# ---- running requests --------------------------------------------------------------------------
def _sse(chunks: AsyncIterator[dict | str]) -> StreamingResponse:
    """Server-sent events of ``chunks``: each a dict, or its JSON text already written."""

    async def body():
        try:
            async for chunk in chunks:
                yield sse_frame(None, chunk)
        except (ValueError, RequestTimeoutError, EngineDeadError, ServerShuttingDownError) as exc:
            yield sse_frame(None, error_body(str(exc), _stream_error_kind(exc)))
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _stream_error_kind(exc: Exception) -> str:
    if isinstance(exc, EngineDeadError | ServerShuttingDownError):
        return "server_error"
    return "timeout_error" if isinstance(exc, RequestTimeoutError) else "invalid_request_error"


def _usage(outputs: list[RequestOutput]) -> dict:
    completion_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
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


# ---- text completions --------------------------------------------------------------------------
def _completion_logprobs(tokenizer: Tokenizer, ids: list[int], logprobs, tops, offset: int) -> dict:
    """Legacy completions logprobs; ``text_offset`` counts characters from the start of the choice's text."""
    tokens = [tokenizer.decode([t]) for t in ids]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "text_offset": offsets,
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in top} for top in (tops or [])] or None}  # fmt: skip


def _completion_response(finals: list[RequestOutput], body: CompletionRequest, settings, tokenizer) -> dict:
    """One choice per (prompt, sample): index ``prompt_index * n + sample``, as OpenAI numbers a batch."""
    choices = []
    for prompt_index, final in enumerate(finals):
        echo = tokenizer.decode(final.prompt_token_ids) if body.echo else ""
        for c in final.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs = _completion_logprobs(tokenizer, c.token_ids, c.logprobs, c.top_logprobs, len(echo))
            choices.append({"index": prompt_index * body.n + c.index, "text": echo + c.text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason})  # fmt: skip
    return {"id": completion_id("cmpl"), "object": "text_completion", "created": now(),
            "model": settings.served_model_name, "choices": choices, "usage": _usage(finals)}  # fmt: skip


async def _completion_chunks(streams, body: CompletionRequest, params: SamplingParams, settings, tokenizer):
    """Chunks of every prompt's choices as they come (``streams`` yields ``(prompt index, output)``)."""
    request_id, created, model = completion_id("cmpl"), now(), settings.served_model_name
    sent_text: dict[int, str] = {}
    sent_tokens: dict[int, int] = {}
    offsets: dict[int, int] = {}
    finals: dict[int, RequestOutput] = {}
    finished: set[int] = set()  # every output repeats the request's finished choices; each ends once
    hold = _hold_back(params)

    def chunk(index: int, text: str, logprobs=None, finish: str | None = None) -> dict:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": [choice]}  # fmt: skip

    async for prompt_index, output in streams:
        finals[prompt_index] = output
        for c in output.outputs:
            index = prompt_index * body.n + c.index
            if index in finished:
                continue
            if index not in sent_text and body.echo:
                echo = tokenizer.decode(output.prompt_token_ids)
                offsets[index] = len(echo)
                yield chunk(index, echo)
            done = c.finish_reason is not None
            if done:
                finished.add(index)
            visible = _visible_text(c.text, done, hold)
            delta = visible[len(sent_text.get(index, "")) :]
            sent_text[index] = visible
            logprobs = None
            start = sent_tokens.get(index, 0)
            if c.logprobs is not None and len(c.token_ids) > start:
                sent_tokens[index] = len(c.token_ids)
                logprobs = _completion_logprobs(tokenizer, c.token_ids[start:], c.logprobs[start:],
                                                (c.top_logprobs or [])[start:], offsets.get(index, 0))  # fmt: skip
                offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            if delta or done or logprobs:
                yield chunk(index, delta, logprobs, c.finish_reason)
    if body.stream_options and body.stream_options.include_usage and finals:
        yield {"id": request_id, "object": "text_completion", "created": created, "model": model,
               "choices": [], "usage": _usage(list(finals.values()))}  # fmt: skip
