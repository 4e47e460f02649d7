"""Engine outputs through deepseek-recipe's stream processor: the chunks and events of each API.

The library's ``StreamProcessor`` turns generated tokens into Chat Completions chunks, Responses events or
Messages events: reasoning until ``</think>``, DSML tool calls, stop sequences (answer text only), finish
reasons and usage. The glue here feeds it the engine's tokens, one processor per choice, and keeps control
tokens away from it: an added token other than ``</think>`` (in thinking mode) and the DSML marker (when
the request has tools) is counted but never decoded, so ``<｜User｜>``, ``<think>`` or bos can never reach
``content`` or ``reasoning_content``. When every processor has finished (a stop sequence, say) the engine request ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import deepseek_recipe as recipe
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from dsinfer.engine.outputs import CompletionOutput, RequestOutput
from dsinfer.server.async_engine import EngineDeadError, RequestTimeoutError
from dsinfer.server.chat_format import ChatFormat, PreparedRequest
from dsinfer.server.disconnect import unless_disconnected

__all__ = [
    "accumulated_document",
    "ChoiceStream",
    "ClientDisconnected",
    "Run",
    "collect",
    "event_api_answer",
    "event_frame",
    "event_json",
    "sse_frame",
    "usage_with_hidden",
]

_FINISH_REASONS = {"stop": recipe.InferenceFinishReason.Stop, "length": recipe.InferenceFinishReason.Length}


class ClientDisconnected(Exception):
    """The client went away before a non-streaming response was ready."""


class ChoiceStream:
    """One choice's tokens through one library stream processor."""

    def __init__(self, chat_format: ChatFormat, prepared: PreparedRequest, generator) -> None:
        self._processor = recipe.StreamProcessor(generator, prepared.parsing_options, chat_format.recipe_tokenizer)
        # </think> ends reasoning only in thinking mode; otherwise the prompt already closed it, and the library
        # would take a generated one for text (a tool argument "</think>imgrad").
        meaningful = {chat_format.think_end_id} if prepared.thinking else set()
        if prepared.parses_tool_calls:
            meaningful.add(chat_format.dsml_id)
        self._hidden = chat_format.control_ids - meaningful
        self._prompt_tokens = len(prepared.prompt_ids)
        self._started = False
        self._sent = 0  # tokens of the completion already pushed
        self.hidden_tokens = 0  # control tokens kept from the parser: usage adds them (see usage_with_hidden)

    @property
    def done(self) -> bool:
        return self._processor.finished

    def push(self, completion: CompletionOutput) -> list:
        """The library's chunks for what ``completion`` (cumulative, as the engine reports it) added."""
        if self.done:
            return []
        events: list = []
        if not self._started:
            self._started = True
            events += self._processor.push(
                recipe.InferenceChunk.ready(prompt_usage=recipe.PromptUsage(prompt_tokens=self._prompt_tokens))
            )
        start, self._sent = self._sent, len(completion.token_ids)
        run: list[int] = []
        run_logprobs: list = []

        def flush() -> None:
            # One token per chunk, whatever the engine step delivered: the library holds back a chunk whose
            # text ends inside a UTF-8 character as a whole, so batching would change what a stream shows.
            for offset, token in enumerate(run):
                if self.done:
                    break
                logprobs = [run_logprobs[offset]] if completion.logprobs is not None else None
                events.extend(self._processor.push(recipe.InferenceChunk.tokens([token], logprobs)))
            run.clear()
            run_logprobs.clear()

        for position in range(start, len(completion.token_ids)):
            token = completion.token_ids[position]
            if token in self._hidden:
                # Not pushed at all: an empty text chunk would make the library drop the bytes it holds back.
                self.hidden_tokens += 1
                continue
            run.append(token)
            if completion.logprobs is not None:
                tops = completion.top_logprobs[position] if completion.top_logprobs else []
                run_logprobs.append((completion.logprobs[position], list(tops)))
        flush()
        if completion.finish_reason is not None and not self.done:
            reason = _FINISH_REASONS.get(completion.finish_reason)
            if reason is not None:
                events += self._processor.push(recipe.InferenceChunk.finish(reason))
            events += self._processor.finish()
        return events

    def close(self) -> None:
        if not self.done:
            self._processor.close()


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
