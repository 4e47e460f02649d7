"""What the API process and the engine processes (ranks) send each other: plain picklable data, never live objects.

A request travels as its specification (token ids, :class:`~dsinfer.sampling_params.SamplingParams` with its
seed and grammar specification, image inputs; stop strings stay in the API process, which detokenizes); the
rank builds the generators and grammar matchers itself. A rank answers each step with what changed: per
completion the new token ids (and logprobs), the finish reason and whether the last token is a hidden stop
token, and the request's timings.

:class:`FrameReader` reads a connection's messages without blocking, for the API process's event loop: it takes
whatever bytes have arrived and unpickles the messages that are whole, keeping a part-arrived one for later.
:class:`FrameWriter` writes them from that loop without blocking it and without losing any: what the pipe cannot
take yet waits, in order, until the loop sees it writable.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import selectors
import socket
import struct
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from multiprocessing.reduction import ForkingPickler

from dsinfer.config import EngineConfig
from dsinfer.engine.outputs import RequestMetrics
from dsinfer.offload.traffic import OffloadTraffic
from dsinfer.parallel.config import ParallelConfig
from dsinfer.sampling_params import SamplingParams
from dsinfer.speculative.executor import SpeculativeStats


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to start: the model, the engine options, its place in the layout."""

    model_dir: str
    engine: EngineConfig
    parallel: ParallelConfig
    rank: int
    master_port: int
    log_level: str = "WARNING"
    load_format: str = "auto"  # 'dummy': random weights (one engine process only, as in-process)


# ---- API process -> rank ------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    images: tuple = ()


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class FinishSequence:
    """A stop string ended completion ``index`` of a request whose other completions go on (``n`` > 1)."""

    request_id: str
    index: int


@dataclass(frozen=True)
class Wake:
    """Sent to every rank with each new request: idle ranks leave their wait and step together."""


@dataclass(frozen=True)
class Shutdown:
    """Every rank stops after the step in progress (they agree on it in their per-step exchange)."""


# ---- rank -> API process ------------------------------------------------------------------------


@dataclass(frozen=True)
class RankReady:
    rank: int
    pid: int
    max_model_len: int
    num_blocks: int
    block_tokens: int
    placement: str
    engram_vocab_size: int | None = None  # V4.1: prompt token ids must lie below it (the Engram hash's vocabulary)


@dataclass
class CompletionDelta:
    index: int
    new_token_ids: list[int]
    finish_reason: str | None  # from token ids alone: a stop token, the grammar's end, the length, an abort
    hide_last_token: bool  # the last token is a stop token the text leaves out
    new_logprobs: list[float] | None = None
    new_top_logprobs: list | None = None

    def __reduce__(self):
        """Pickled as its fields' tuple: every running request sends one each step (half the time of the
        default, which pickles each instance's dictionary)."""
        fields = (self.index, self.new_token_ids, self.finish_reason, self.hide_last_token, self.new_logprobs,
                  self.new_top_logprobs)  # fmt: skip
        return CompletionDelta, fields


_METRICS_FIELDS = tuple(f.name for f in dataclass_fields(RequestMetrics))


@dataclass
class RequestDelta:
    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    metrics: RequestMetrics

    def __reduce__(self):
        """Pickled as tuples, as :class:`CompletionDelta` is (the timings too)."""
        metrics = tuple(getattr(self.metrics, name) for name in _METRICS_FIELDS)
        return _request_delta, (self.request_id, self.completions, self.finished, metrics)


def _request_delta(request_id: str, completions: list, finished: bool, metrics: tuple) -> RequestDelta:
    return RequestDelta(request_id, completions, finished, RequestMetrics(*metrics))


@dataclass
class RankLoad:
    """The counters the API process shows as metrics and balances by."""

    waiting: int = 0
    running: int = 0
    blocks_used: int = 0
    num_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0
    graph_steps: int = 0  # forwards run in a decode bucket (dsinfer.parallel.graph_steps)
    padded_graph_steps: int = 0  # idle steps run as a decode bucket of padding rows
    spec_stats: SpeculativeStats | None = None  # speculative decoding's totals on this rank
    expert_offload: OffloadTraffic | None = None  # expert-offload traffic on this rank (None: none offloaded)


_LOAD_FIELDS = tuple(f.name for f in dataclass_fields(RankLoad))
assert _METRICS_FIELDS == ("arrival_time", "first_scheduled_time", "first_token_time", "finish_time")


@dataclass
class StepReport:
    rank: int
    deltas: list[RequestDelta] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (request id, message)
    load: RankLoad = field(default_factory=RankLoad)

    def __reduce__(self):
        """Pickled as plain tuples built in one call: the engine process sends one report a step, and 16 requests'
        deltas pickled object by object took four times as long (each object's ``__reduce__`` is a Python call)."""
        deltas = [
            (
                d.request_id,
                [(c.index, c.new_token_ids, c.finish_reason, c.hide_last_token, c.new_logprobs, c.new_top_logprobs)
                 for c in d.completions],
                d.finished,
                (d.metrics.arrival_time, d.metrics.first_scheduled_time, d.metrics.first_token_time,
                 d.metrics.finish_time),
            )
            for d in self.deltas
        ]  # fmt: skip
        load = tuple(getattr(self.load, name) for name in _LOAD_FIELDS)
        return _step_report, (self.rank, deltas, self.rejected, load)


def _step_report(rank: int, deltas: list, rejected: list, load: tuple) -> StepReport:
    return StepReport(
        rank,
        [RequestDelta(request_id, [CompletionDelta(*c) for c in completions], finished, RequestMetrics(*metrics))
         for request_id, completions, finished, metrics in deltas],
        rejected,
        RankLoad(*load),
    )  # fmt: skip


@dataclass(frozen=True)
class RankFailed:
    """``error``: the exception itself when it pickles, so that one engine process that fails while starting
    raises what an in-process engine would (a bad ``--speculative-config`` stays a ``ConfigError``)."""

    rank: int
    message: str
    error: BaseException | None = None


# ---- reading a connection in an event loop ------------------------------------------------------

_SIZE, _LONG_SIZE = struct.Struct("!i"), struct.Struct("!Q")
_READ_BYTES = 1 << 18


class FrameReader:
    """The messages of a :class:`multiprocessing.connection.Connection`, read without blocking.

    ``read()`` takes the bytes the socket holds now (``MSG_DONTWAIT``: the connection's own blocking ``send`` is
    untouched) and returns every message they complete, in the connection's framing (a 4-byte big-endian size,
    ``-1`` then an 8-byte size for a message of 2 GiB or more, then the pickle); a message that has arrived in
    part stays buffered until the rest comes. It raises ``EOFError`` once the peer has closed and every whole
    message has been returned. A connection that is no socket (a one-way pipe) is read with ``recv``, one
    message per readable event."""

    def __init__(self, conn) -> None:
        self.conn, self._buffer, self._closed = conn, bytearray(), False
        try:
            self._sock: socket.socket | None = socket.socket(fileno=os.dup(conn.fileno()))
        except OSError:
            self._sock = None

    def fileno(self) -> int:
        return self.conn.fileno()

    def read(self) -> list:
        if self._sock is None:
            return [self.conn.recv()] if self.conn.poll() else []
        buffer = self._buffer
        while not self._closed:
            try:
                chunk = self._sock.recv(_READ_BYTES, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # reset by a peer that died
                chunk = b""
            if not chunk:
                self._closed = True
                break
            buffer += chunk
            if len(chunk) < _READ_BYTES:
                break
        messages, start, end = [], 0, len(buffer)
        while end - start >= 4:
            (size,), head = _SIZE.unpack_from(buffer, start), 4
            if size == -1:
                if end - start < 12:
                    break
                (size,), head = _LONG_SIZE.unpack_from(buffer, start + 4), 12
            if end - start < head + size:
                break
            messages.append(pickle.loads(buffer[start + head : start + head + size]))
            start += head + size
        del buffer[:start]
        if self._closed and not messages:
            raise EOFError("the connection was closed")
        return messages

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class FrameWriter:
    """Messages to a :class:`multiprocessing.connection.Connection`, written whole and in order, never lost.

    ``Connection.send`` assumes a blocking descriptor. The API process's end of an engine pipe is not always one:
    uvloop makes every descriptor it watches non-blocking (libuv's poll handle), and the event loop watches the
    pipe for the engine's reports. On a full pipe (a burst of long prompts while the engine is in a step) ``send``
    then raised ``BlockingIOError`` after writing nothing or part of a message, and the request was lost. Here a
    message is framed as ``Connection.send`` frames it (what the peer's ``recv`` reads) and written as far as the
    pipe takes it; while :meth:`attach`-ed to an event loop (which makes the descriptor non-blocking, whatever the
    loop) the rest waits for the loop to see the pipe writable, so the loop never blocks on the engine either;
    otherwise it waits for the pipe right here. Write from one thread at a time."""

    def __init__(self, conn) -> None:
        self.conn, self._pending, self._loop = conn, bytearray(), None

    @property
    def pending(self) -> int:
        """Bytes not yet written."""
        return len(self._pending)

    def send(self, message) -> None:
        """Queue ``message`` and write what the pipe takes; ``OSError`` once the peer is gone (nothing pending
        then)."""
        payload = ForkingPickler.dumps(message)
        size = len(payload)
        header = _SIZE.pack(size) if size <= 0x7FFFFFFF else _SIZE.pack(-1) + _LONG_SIZE.pack(size)
        waiting = bool(self._pending)
        self._pending += header
        self._pending += payload
        if self._loop is None:
            self._write_all()
        elif not waiting:  # else the loop is already waiting for the pipe to drain
            self._write_some()

    def attach(self, loop) -> None:
        """Write from ``loop`` from now on, never blocking it (call in the loop's thread)."""
        self.detach()
        os.set_blocking(self.conn.fileno(), False)
        self._loop = loop
        if self._pending:
            self._write_some()

    def detach(self) -> None:
        """Write blocking again (the rest of a pending message first)."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if not loop.is_closed():
            loop.remove_writer(self.conn.fileno())
        os.set_blocking(self.conn.fileno(), True)
        with contextlib.suppress(OSError):  # a peer that is gone is reported by its reader or its process
            self._write_all()

    def _write_some(self) -> None:
        """In the loop: write what the pipe takes now; watch it for the rest."""
        try:
            written = self._write_now()
        except OSError:  # the peer is gone: its reader reports it
            self._pending.clear()
            written = True
        if written:
            self._loop.remove_writer(self.conn.fileno())
        else:
            self._loop.add_writer(self.conn.fileno(), self._write_some)

    def _write_all(self) -> None:
        """Without a loop: write everything, waiting for the pipe as long as it takes."""
        try:
            while not self._write_now():  # only a non-blocking descriptor gets here (one a loop left so)
                with selectors.DefaultSelector() as selector:
                    selector.register(self.conn.fileno(), selectors.EVENT_WRITE)
                    selector.select()
        except OSError:
            self._pending.clear()
            raise

    def _write_now(self) -> bool:
        """Write until done (True) or the pipe is full (False)."""
        fd = self.conn.fileno()
        while self._pending:
            try:
                written = os.write(fd, self._pending)
            except BlockingIOError:
                return False
            del self._pending[:written]
        return True
