"""``--api-key``: every route but ``/health`` needs the key (the API, /metrics, /tokenize, the docs, the schema).

A pure ASGI middleware rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` wraps the
``receive`` channel, which hides a client's disconnect from the handler behind it (a non-streaming request
would then run to its end for nobody). The key is accepted as ``Authorization: Bearer KEY`` (OpenAI clients)
or ``x-api-key: KEY`` (Anthropic clients); either one carrying the key is enough.
"""

from __future__ import annotations

import json
import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from dsinfer.server.protocol import error_body

OPEN_PATHS = frozenset({"/health"})  # load balancers and orchestrators probe it without credentials


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body("invalid or missing API key", "authentication_error")).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"www-authenticate", b"Bearer")]  # fmt: skip
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: Scope) -> bool:
        """Either header carrying the key authenticates (a client may send a stale one of the other kind)."""
        headers = dict(scope["headers"])
        supplied = [headers.get(b"x-api-key", b"")]
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer":
            supplied.append(token.strip())
        matches = [secrets.compare_digest(candidate, self._expected) for candidate in supplied]  # both compared
        return any(matches)
