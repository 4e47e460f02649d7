"""The request side of ``dsinfer bench serve``: stream one request and record what it did.

Two clients fill the same :class:`RequestRecord`:

* ``light`` (the default): httpx streams the response and the server-sent events are split and parsed here, one
  ``json.loads`` per ``data:`` line: a small share of a core per chunk (``python benchmarks/serve_host_cost.py
  client``; docs/perf.md, history), so one core keeps up with many streams at a few milliseconds per token and
  reads each chunk when it arrives.
* ``openai``: the openai SDK (``AsyncOpenAI`` over httpx, a pydantic object per chunk), for comparison. It costs
  an order of magnitude more CPU per chunk; on a loaded core 16 streams at a millisecond-scale step outrun it,
  and a client that falls behind reads two steps' chunks back to back (an ITL near zero next to a double one).

Every chunk of one network read carries the time of that read (as vLLM's client times them). Outcomes are as
:mod:`dsinfer.bench.serving` describes them: an error event in the stream (``event: error`` or a data object with
an ``error`` key), an HTTP error status (with the server's message) or any exception makes the request *errored*;
``--request-timeout`` or an httpx timeout makes it *incomplete*.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from dsinfer.bench.datasets import BenchRequest

CLIENTS = ("light", "openai")
HTTP_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
SDK_ARGUMENTS = ("model", "stream", "stream_options", "max_tokens", "temperature", "messages",
                 "max_completion_tokens", "prompt")  # fmt: skip


@dataclass
class RequestRecord:
    """What one request did; times are seconds, ``start_s`` / ``end_s`` relative to the benchmark start."""

    index: int
    status: str = "errored"  # successful | errored | incomplete
    error: str = ""
    scheduled_s: float = 0.0
    start_s: float = 0.0
    end_s: float = 0.0
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    output_tokens_source: str = "none"  # usage | chunks | none
    expected_output_len: int = 0
    finish_reason: str | None = None
    generated_text: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.status != "successful" or self.output_tokens <= 1:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


class StreamError(Exception):
    """The server reported an error: an HTTP error status, or an error event inside the stream."""


def request_body(args: argparse.Namespace, request: BenchRequest) -> dict[str, Any]:
    """The JSON body of one streamed request (``--extra-body`` merged at the top level, as the openai SDK does)."""
    body: dict[str, Any] = {
        "model": args.model, "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": request.output_len, "temperature": args.temperature,
    }  # fmt: skip
    if args.endpoint == "chat":
        body["messages"] = request.chat_messages()
        body["max_completion_tokens"] = request.output_len
    else:
        body["prompt"] = request.prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(args.extra_body or {})
    return body


def _finish(record: RequestRecord, start: float, last: float, bench_start: float, token_times: list[float],
            pieces: list[str], completion_tokens: int | None, prompt_tokens: int | None) -> RequestRecord:  # fmt: skip
    """Fill the record's outcome and timings from what the stream delivered (its status is set unless it ran
    to its end)."""
    if record.status == "running":
        if not token_times:
            record.status, record.error = "errored", "the stream carried no generated text"
        elif record.finish_reason is None:
            record.status, record.error = "incomplete", "the stream ended without a finish_reason"
        else:
            record.status = "successful"
    end = time.perf_counter() if record.status != "successful" else last
    record.end_s = end - bench_start
    record.generated_text = "".join(pieces)
    if token_times:
        record.ttft_s = token_times[0] - start
        record.itl_s = [b - a for a, b in zip(token_times, token_times[1:], strict=False)]
        record.e2el_s = last - start
    if completion_tokens is not None:
        record.output_tokens, record.output_tokens_source = completion_tokens, "usage"
        record.prompt_tokens = prompt_tokens if prompt_tokens is not None else record.prompt_tokens
    elif token_times:
        record.output_tokens, record.output_tokens_source = len(token_times), "chunks"
    return record


# ---- the light client ------------------------------------------------------------------------------
class EventReader:
    """Incremental server-sent-events parser: bytes in, ``(event name or None, data)`` per complete event out.

    Lines end in LF, CRLF or CR; an event ends at a blank line; its ``data:`` lines are joined with LF (one
    space after the colon dropped); comments and other fields are skipped. The common event, one ``data:``
    line, takes one split and one slice."""

    def __init__(self) -> None:
        self._pending = b""
        self._after_cr = False  # the last read ended in CR: an LF that starts the next one belongs to it

    def feed(self, data: bytes) -> list[tuple[str | None, bytes]]:
        if self._after_cr and data.startswith(b"\n"):
            data = data[1:]
        buffer = self._pending + data
        self._after_cr = False
        if b"\r" in buffer:
            self._after_cr = buffer.endswith(b"\r")
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *events, self._pending = buffer.split(b"\n\n")
        out = []
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:
                out.append((None, event[6:]))
                continue
            name, data = None, []
            for line in event.split(b"\n"):
                key, _, value = line.partition(b":")
                value = value[1:] if value.startswith(b" ") else value
                if key == b"data":
                    data.append(value)
                elif key == b"event":
                    name = value.decode("utf-8", "replace")
            if data:
                out.append((name, b"\n".join(data)))
        return out


def _chunk_text_json(choice: dict[str, Any], endpoint: str) -> str:
    """Generated text in one streamed choice (a parsed JSON object): answer, reasoning or tool-call text."""
    if endpoint == "completions":
        text = choice.get("text")
        return text if isinstance(text, str) else ""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return ""
    # Servers that send both reasoning spellings (vLLM's and DeepSeek's) send the same text twice.
    parts = [delta.get("content"), delta.get("reasoning_content") or delta.get("reasoning")]
    for call in delta.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            parts += [function.get("name"), function.get("arguments")]
    return "".join(p for p in parts if isinstance(p, str))


def _error_message(payload: Any, fallback: str) -> str:
    """The message of an OpenAI-style error object (``{"error": {"message": ...}}``), FastAPI's ``detail``, or
    the text itself."""
    if isinstance(payload, dict):
        error = payload.get("error", payload)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(error, str):
            return error
        if "detail" in payload:
            return str(payload["detail"])
    return fallback


class LightClient:
    """httpx streams, server-sent events parsed here; one connection per request in flight."""

    name = "light"

    def __init__(self, args: argparse.Namespace, connections: int, transport: httpx.AsyncBaseTransport | None = None):
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        self.http = httpx.AsyncClient(headers=headers, timeout=HTTP_TIMEOUT, limits=limits, transport=transport)
        self.url = f"{args.api_url}/chat/completions" if args.endpoint == "chat" else f"{args.api_url}/completions"

    async def close(self) -> None:
        await self.http.aclose()

    async def send(self, args: argparse.Namespace, request: BenchRequest, record: RequestRecord,
                   bench_start: float) -> RequestRecord:  # fmt: skip
        """Stream one request and fill ``record``; every failure is caught and classified, never raised."""
        record.expected_output_len, record.prompt_tokens = request.output_len, request.prompt_tokens
        endpoint, loads = args.endpoint, json.loads
        token_times: list[float] = []
        pieces: list[str] = []
        usage: dict[str, Any] | None = None
        reader = EventReader()
        body = json.dumps(request_body(args, request)).encode()
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        record.status = "running"
        start = last = time.perf_counter()
        record.start_s = start - bench_start
        try:
            async with asyncio.timeout(args.request_timeout):
                # Leaving the block early closes the connection, which lets the server abort the request.
                async with self.http.stream("POST", self.url, content=body, headers=headers) as response:
                    if response.status_code >= 400:
                        text = (await response.aread()).decode("utf-8", "replace")
                        try:
                            message = _error_message(json.loads(text), text)
                        except ValueError:
                            message = text
                        raise StreamError(f"HTTP {response.status_code}: {message.strip()[:500]}")
                    async for data in response.aiter_bytes():
                        last = time.perf_counter()
                        for name, payload in reader.feed(data):
                            if payload == b"[DONE]":
                                continue
                            chunk = loads(payload)
                            if name == "error" or (isinstance(chunk, dict) and "error" in chunk):
                                raise StreamError(f"error event: {_error_message(chunk, payload.decode())}")
                            usage = chunk.get("usage") or usage
                            for choice in chunk.get("choices") or ():
                                text = _chunk_text_json(choice, endpoint)
                                if text:
                                    token_times.append(last)
                                    pieces.append(text)
                                record.finish_reason = choice.get("finish_reason") or record.finish_reason
        except (TimeoutError, httpx.TimeoutException) as exc:
            record.status, record.error = "incomplete", f"timed out: {type(exc).__name__}"
        except StreamError as exc:
            record.status, record.error = "errored", str(exc)
        except Exception as exc:  # noqa: BLE001 - a benchmark counts failures of any kind and keeps going
            record.status, record.error = "errored", f"{type(exc).__name__}: {exc}"
        usage = usage if isinstance(usage, dict) else {}
        return _finish(record, start, last, bench_start, token_times, pieces, usage.get("completion_tokens"),
                       usage.get("prompt_tokens"))  # fmt: skip


# ---- the openai SDK ----------------------------------------------------------------------------------
def _chunk_text_sdk(choice: Any, endpoint: str) -> str:
    """Generated text in one streamed choice (an SDK object): answer, reasoning (two spellings) or tool calls."""
    if endpoint == "completions":
        return choice.text or ""
    delta = choice.delta
    if delta is None:
        return ""
    extra = delta.model_extra or {}
    parts = [delta.content, extra.get("reasoning_content") or extra.get("reasoning")]
    for call in delta.tool_calls or []:
        if call.function is not None:
            parts += [call.function.name or "", call.function.arguments or ""]
    return "".join(p for p in parts if isinstance(p, str))


class OpenAIClient:
    """openai's ``AsyncOpenAI`` (no retries: a retried request would hide a failure and distort its latency)."""

    name = "openai"

    def __init__(self, args: argparse.Namespace, connections: int, transport: httpx.AsyncBaseTransport | None = None):
        import openai

        self.openai = openai
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        if transport is None:
            http = openai.DefaultAsyncHttpxClient(limits=limits)
        else:  # a test's transport is httpx's, which the SDK's own client class may not take
            http = httpx.AsyncClient(limits=limits, transport=transport)
        self.client = openai.AsyncOpenAI(base_url=args.api_url, api_key=args.api_key or "EMPTY", max_retries=0,
                                         timeout=HTTP_TIMEOUT, http_client=http)  # fmt: skip
        _ = self.client.chat.completions, self.client.completions  # import the lazy resources before the clock

    async def close(self) -> None:
        await self.client.close()

    async def send(self, args: argparse.Namespace, request: BenchRequest, record: RequestRecord,
                   bench_start: float) -> RequestRecord:  # fmt: skip
        record.expected_output_len, record.prompt_tokens = request.output_len, request.prompt_tokens
        openai = self.openai
        client = self.client
        create = client.chat.completions.create if args.endpoint == "chat" else client.completions.create
        body = request_body(args, request)
        kwargs = {key: body.pop(key) for key in SDK_ARGUMENTS if key in body}  # the rest goes as extra_body
        token_times, pieces, usage = [], [], None
        record.status = "running"
        start = last = time.perf_counter()
        record.start_s = start - bench_start
        try:
            async with asyncio.timeout(args.request_timeout):
                stream = await create(**kwargs, extra_body=body)
                async with stream:  # closing the connection on a timeout lets the server abort the request
                    async for chunk in stream:
                        last = time.perf_counter()
                        usage = chunk.usage or usage
                        for choice in chunk.choices:
                            text = _chunk_text_sdk(choice, args.endpoint)
                            if text:
                                token_times.append(last)
                                pieces.append(text)
                            record.finish_reason = choice.finish_reason or record.finish_reason
        except (TimeoutError, openai.APITimeoutError) as exc:
            record.status, record.error = "incomplete", f"timed out: {type(exc).__name__}"
        except openai.APIStatusError as exc:
            message = _error_message(exc.body, exc.message.removeprefix(f"Error code: {exc.status_code} - "))
            record.status, record.error = "errored", f"HTTP {exc.status_code}: {message}"
        except Exception as exc:  # noqa: BLE001 - a benchmark counts failures of any kind and keeps going
            record.status, record.error = "errored", f"{type(exc).__name__}: {exc}"
        return _finish(record, start, last, bench_start, token_times, pieces,
                       usage.completion_tokens if usage is not None else None,
                       usage.prompt_tokens if usage is not None else None)  # fmt: skip


def make_client(args: argparse.Namespace, connections: int, transport: httpx.AsyncBaseTransport | None = None):
    """The client ``--client`` names, with a pool of ``connections`` (``transport``: a test's or a mock's)."""
    kind = {"light": LightClient, "openai": OpenAIClient}[getattr(args, "client", "light")]
    return kind(args, connections, transport)
