"""A request's choice streams (:class:`~dsinfer.chat.stream.ChoiceStream`) as the chunks and events of each API.

:class:`Run` drives the engine stream through one library stream processor per choice; the helpers here drain it
for a non-streaming answer or frame it as server-sent events. When every processor has finished (a stop sequence,
say) the engine request ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from dsinfer.chat.stream import ChoiceStream
from dsinfer.engine.outputs import RequestOutput
from dsinfer.server.async_engine import EngineDeadError, RequestTimeoutError
from dsinfer.server.disconnect import unless_disconnected

__all__ = [
    "accumulated_document",
    "ClientDisconnected",
    "Run",
    "collect",
    "event_api_answer",
    "event_frame",
    "event_json",
    "sse_frame",
    "usage_with_hidden",
]


class ClientDisconnected(Exception):
    """The client went away before a non-streaming response was ready."""


@dataclass
class Run:
    """A request's engine stream and its choice processors; iterate to get ``(choice index, chunks)``.

    ``finish`` (the engine's :meth:`~dsinfer.server.async_engine.AsyncEngine.finish`) is told when every choice's
    parser has finished before the engine did (a stop sequence), so the request ends as ``stop``, not ``abort``.
    """

    stream: AsyncIterator[RequestOutput]
    choices: list[ChoiceStream]
    finish: Callable[[str], None] | None = None
    final: RequestOutput | None = field(default=None)

    async def __aiter__(self):
        try:
            async for output in self.stream:
                self.final = output
                for completion in output.outputs:
                    events = self.choices[completion.index].push(completion)
                    if events:
                        yield completion.index, events
                if all(choice.done for choice in self.choices):
                    if self.finish is not None and not output.finished:
                        self.finish(output.request_id)
                    break  # e.g. a stop sequence: the engine request ends with the stream
        finally:
            await self.stream.aclose()
            for choice in self.choices:
                choice.close()

    def usage(self) -> dict[str, int]:
        """Token counts as the engine ran them (every choice's tokens, control tokens included)."""
        prompt = len(self.final.prompt_token_ids) if self.final else 0
        completion = sum(len(c.token_ids) for c in self.final.outputs) if self.final else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def collect(run: Run, request: Request | None) -> list[tuple[int, list]]:
    """Drain a non-streaming request; a client that disconnects meanwhile aborts it (every choice)."""

    async def drain() -> list[tuple[int, list]]:
        return [item async for item in run]

    if request is None:
        return await drain()
    return await unless_disconnected(drain(), request)


async def accumulated_document(run: Run, request: Request, response) -> dict[str, Any]:
    """A non-streaming Responses / Messages document: the library's response fed every event, usage as run."""
    for _, events in await collect(run, request):
        for event in events:
            response.accumulate(event)
    return usage_with_hidden(json.loads(response.to_json()), run.choices[0].hidden_tokens)


async def event_api_answer(
    run: Run, request: Request, stream: bool, response, error_event: Callable[[Exception], dict[str, Any]]
) -> Response:
    """A Responses / Messages answer from its run: the library's events as server-sent events named by the API
    (``response``'s type), or, not streaming, the document ``response`` accumulates. A stream that fails after
    its first event cannot change its status any more, so it ends with the API's error event (``error_event``)."""
    if stream:
        return StreamingResponse(
            _named_events(run, type(response), error_event),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    document = await accumulated_document(run, request, response)
    return Response(json.dumps(document, ensure_ascii=False), media_type="application/json")


async def _named_events(run: Run, response_type, error_event: Callable[[Exception], dict[str, Any]]):
    try:
        async for _, events in run:
            for event in events:
                yield event_frame(response_type.sse_event_name(event), event, run.choices[0].hidden_tokens)
    except (ValueError, RequestTimeoutError, EngineDeadError) as exc:
        yield sse_frame("error", error_event(exc))


def event_json(event) -> dict[str, Any]:
    return json.loads(event.to_json())


def event_frame(name: str | None, event, hidden_tokens: int) -> str:
    """A Responses / Messages event as a server-sent event, usage counting the hidden control tokens. Only an
    event that carries usage is parsed and written again; the others go out as the library wrote them."""
    text = event.to_json()
    if hidden_tokens and '"usage"' in text:  # quotes in JSON strings are escaped: this is a key, not text
        return sse_frame(name, usage_with_hidden(json.loads(text), hidden_tokens))
    return sse_frame(name, text)


def usage_with_hidden(document: Any, hidden_tokens: int) -> Any:
    """Add the control tokens the parser never saw to every output-token count in a Responses / Messages
    document, so usage counts what the engine generated."""
    if isinstance(document, dict):
        usage = document.get("usage")
        if isinstance(usage, dict) and hidden_tokens:
            for key in ("output_tokens", "total_tokens"):
                if isinstance(usage.get(key), int):
                    usage[key] += hidden_tokens
        for key, value in document.items():
            if key != "usage":
                usage_with_hidden(value, hidden_tokens)
    elif isinstance(document, list):
        for item in document:
            usage_with_hidden(item, hidden_tokens)
    return document


def sse_frame(name: str | None, data: dict[str, Any] | str) -> str:
    """One server-sent event: ``event:`` line when the protocol names its events, then the data line (``data``
    is an object, or its JSON text)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return (f"event: {name}\n" if name else "") + f"data: {text}\n\n"
