"""What a request body must be before any handler reads it: small enough (413), then JSON of a sane shape (400).

Two gates, in the order a body arrives:

* :class:`RequestSizeLimit`, a pure ASGI middleware, answers 413 for a body over ``--max-request-bytes``: at
  once when ``Content-Length`` says so, or as soon as a streamed (chunked) body passes the limit. The rest of the
  body is read and dropped (up to :data:`DRAIN_LIMIT_BYTES`), so the client reads the 413 and its keep-alive
  connection stays usable; nothing of it is kept.
* :class:`GuardedRoute` parses JSON bodies in a worker thread (a large body never stalls ``/health``) and
  checks what the protocol library and the engine cannot take: nesting deeper than :data:`MAX_JSON_DEPTH`
  (deepseek-recipe stops at 128 with a ``RecursionError``), integers outside 64 bits (``OverflowError`` in
  the library), NaN / Infinity (Python's ``json`` accepts them; JSON does not) and lone surrogates (``"\\udfff"``
  escapes, which no tokenizer can encode). Each is a 400 naming the field, as OpenAI answers a bad value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsinfer.server.protocol import error_body

DEFAULT_MAX_REQUEST_BYTES = 64 * 2**20  # a long prompt and a couple of images; --max-request-bytes raises it
DRAIN_LIMIT_BYTES = 256 * 2**20  # past this an oversized body is not read to its end: the connection closes
MAX_JSON_DEPTH = 100  # any real schema or tool definition fits; the protocol library refuses beyond 128
INT64_RANGE = (-(2**63), 2**64 - 1)  # signed and unsigned 64-bit values both pass; seeds are u64 upstream


class BodyTooLarge(HTTPException):
    """A request body over the server's limit (413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than this server's limit of {limit} bytes "
                         "(--max-request-bytes)")  # fmt: skip


class BadBodyValue(HTTPException):
    """A JSON value no field may hold (400); ``param`` is its path, e.g. ``messages.0.content``."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(400, message)
        self.param = param


class RequestSizeLimit:
    """ASGI middleware: a body over ``max_bytes`` is a 413 before anything parses it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(receive, send, already_read=0, declared=declared)
            return
        received = 0
        refused = False

        async def counted() -> Message:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    raise BodyTooLarge(self.max_bytes)  # the app's handler turns it into the 413 JSON
            return message

        async def drained_send(message: Message) -> None:
            if refused and message["type"] == "http.response.start":  # read the rest first: the client is still
                await _drain(receive, received)  # writing and would see a reset instead of the answer
            await send(message)

        await self.app(scope, counted, drained_send)

    async def _refuse(self, receive: Receive, send: Send, already_read: int, declared: int) -> None:
        body = json.dumps(error_body(str(BodyTooLarge(self.max_bytes).detail), param="body",
                                     code="request_too_large")).encode()  # fmt: skip
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if declared > DRAIN_LIMIT_BYTES or not await _drain(receive, already_read):
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _drain(receive: Receive, already_read: int) -> bool:
    """Read and drop the rest of a request body; False when it ran past :data:`DRAIN_LIMIT_BYTES`."""
    total = already_read
    while total <= DRAIN_LIMIT_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return False
        total += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return False


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class GuardedRequest(Request):
    """A request whose JSON is parsed off the event loop and checked by :func:`checked_json`."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await run_in_threadpool(checked_json, body)
        return self._json


class GuardedRoute(APIRoute):
    """FastAPI route class whose handlers see :class:`GuardedRequest` (set as ``app.router.route_class``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            return await handler(GuardedRequest(request.scope, request.receive))

        return guarded


def checked_json(body: bytes | str) -> Any:
    """``json.loads`` of a request body, refusing what no field may hold (:class:`BadBodyValue`, 400).

    ``json.JSONDecodeError`` passes through (FastAPI answers it as malformed JSON); nesting too deep for
    ``json`` itself to parse is answered as too deep, like any other nesting past :data:`MAX_JSON_DEPTH`.
    """
    try:
        value = json.loads(body)  # NaN and Infinity parse as floats: the walk refuses them by name
    except RecursionError:
        raise BadBodyValue(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels", None) from None
    check_json_value(value)
    return value


def check_json_value(value: Any) -> None:
    """Walk a parsed body (iteratively: depth is what is being checked) and refuse the first bad value."""
    low, high = INT64_RANGE
    pending: list[tuple[Any, tuple, int]] = [(value, (), 1)]
    while pending:
        item, path, depth = pending.pop()
        if isinstance(item, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise BadBodyValue(f"{_named(path)}nested deeper than {MAX_JSON_DEPTH} levels", _param(path))
            if isinstance(item, dict):
                for key in item:
                    if not key.isascii():
                        _check_encodable(key, path)
            children = item.items() if isinstance(item, dict) else enumerate(item)
            pending.extend((child, (*path, key), depth + 1) for key, child in children)
        elif isinstance(item, str):
            if not item.isascii():
                _check_encodable(item, path)
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if not low <= item <= high:
                raise BadBodyValue(f"{_named(path)}the integer {_short(item)} is outside the 64-bit range",
                                   _param(path))  # fmt: skip
        elif isinstance(item, float) and not math.isfinite(item):
            raise BadBodyValue(f"{_named(path)}must be a finite number, got {item}", _param(path))


def _check_encodable(text: str, path: tuple) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadBodyValue(
            f"{_named(path)}contains a lone surrogate ({text[exc.start]!r} at character {exc.start}): "
            "send valid Unicode (surrogate pairs must come in pairs)",
            _param(path),
        ) from None


def _param(path: tuple) -> str | None:
    return ".".join(str(part) for part in path) or None


def _named(path: tuple) -> str:
    return f"{_param(path)}: " if path else ""


def _short(number: int) -> str:
    text = str(number) if number.bit_length() < 256 else f"of {number.bit_length()} bits"
    return text if len(text) <= 40 else text[:20] + "..." + text[-8:]
