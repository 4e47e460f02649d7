"""The HTTP side's engine: requests in, each request's outputs out through an asyncio queue.

With the engine in this process (``--engine-in-process``, embedding code, tests) it runs in its own thread, fed by
a command queue: HTTP handlers post "add" and "end" commands and await their request's channel. The engine thread
applies commands between steps, steps while there is work, delivers each request's outputs to its channel, ends
requests past their deadline, and keeps the metrics current. A client that goes away aborts its request, which
frees its cache before the next step.

With the engine in processes of its own (``dsinfer serve``'s default, :class:`~dsinfer.parallel.ranked_engine.
RankedEngine`) there is no engine thread: the event loop sends a request to the engine process as the handler
asks, and reads the engine's pipe itself (:meth:`AsyncEngine.attach`, at the app's startup), so each step's report
becomes every stream's output in the one wake-up that reads it; deadlines are timers of the loop.

Either engine is driven through :class:`~dsinfer.engine.client.EngineClient` alone: requests in, outputs out, and
its counters (:class:`~dsinfer.engine.client.EngineLoad`) for the metrics and ``--max-queue``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from dsinfer.engine.client import EngineClient, ReportingEngineClient
from dsinfer.engine.outputs import RequestOutput
from dsinfer.offload.traffic import OffloadTraffic
from dsinfer.sampling_params import SamplingParams
from dsinfer.server.metrics import OFFLOAD_COUNTERS, OFFLOAD_GAUGES, ServerMetrics
from dsinfer.speculative.executor import SpeculativeStats

log = logging.getLogger("dsinfer.server")


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an internal error; the server can no longer generate."""


class QueueFullError(RuntimeError):
    """More requests are waiting than ``--max-queue`` allows."""


class RequestTimeoutError(RuntimeError):
    """The request ran longer than ``--request-timeout``."""


class ServerShuttingDownError(RuntimeError):
    """The server is shutting down and ``--drain-timeout`` has passed: in-flight requests are ended."""


@dataclass
class _Channel:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    deadline: float | None
    last_token_time: dict[int, float] = field(default_factory=dict)
    tokens_seen: dict[int, int] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None  # the deadline, with the engine in other processes
    ended_by_consumer: str | None = None  # the finish reason its consumer gave (see AsyncEngine.finish)


class AsyncEngine:
    def __init__(
        self,
        engine: EngineClient,
        metrics: ServerMetrics,
        max_queue: int | None = None,
        request_timeout: float | None = None,
    ) -> None:
        self.engine, self.metrics = engine, metrics
        self.max_queue, self.request_timeout = max_queue, request_timeout
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._channels: dict[str, _Channel] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._pending_adds = 0
        self._shutdown_message: str | None = None  # set once in-flight requests have been cut for shutdown
        self._exported_prefix = (0, 0)  # prefix-cache counters already added to the metrics
        self._exported_spec = SpeculativeStats()  # speculative-decoding counters already added
        self._exported_offload = OffloadTraffic()  # expert-offload counters already added
        self.alive = False
        self.thread = threading.Thread(target=self._run, name="dsinfer-engine", daemon=True)
        # An engine in other processes is read in the event loop instead (no engine thread): see attach().
        self.loop_driven = isinstance(engine, ReportingEngineClient)
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self.alive = True
        if not self.loop_driven:
            self.thread.start()

    def attach(self) -> None:
        """Read an engine in other processes in the running event loop (the app's startup calls this; the
        first request does where nothing did). Nothing to do for an engine in this process."""
        loop = asyncio.get_running_loop()
        if not self.loop_driven or self._loop is loop:
            return
        self._loop = loop
        self.engine.attach(loop, self._on_outputs, self._on_engine_failure)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.loop_driven:
            self.engine.detach()
            self.engine.close()  # the engine processes finish the step in progress, then exit
        else:
            self.thread.join(timeout=30)
            if not self.thread.is_alive():
                self.engine.close()  # the device worker finishes a step still in flight, then exits
        self.alive = False

    @property
    def num_waiting(self) -> int:
        return self.engine.load().waiting + self._pending_adds

    # ---- the HTTP side -----------------------------------------------------------------------
    async def generate(
        self, prompt: list[int], params: SamplingParams, images: list | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the iteration early (disconnect, cancel) aborts the request, unless
        its consumer said it completed it first (:meth:`finish`)."""
        if not self.alive:
            raise EngineDeadError("the engine has stopped; see the server log")
        if self.max_queue is not None and self.num_waiting >= self.max_queue:
            raise QueueFullError(f"{self.num_waiting} requests are already waiting (--max-queue {self.max_queue})")
        request_id = f"req-{next(self._ids)}"
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        channel = _Channel(asyncio.get_running_loop(), asyncio.Queue(), deadline)
        if self.loop_driven:
            self.attach()
            if self._shutdown_message is not None:
                raise ServerShuttingDownError(self._shutdown_message)
            try:
                self.engine.add_request(prompt, params, request_id=request_id, images=images)  # ValueError: a 4xx
            except RuntimeError as exc:  # the engine processes are gone (RankDiedError)
                raise EngineDeadError(f"the engine failed: {exc}") from exc
            self._pending_adds += 1  # waiting until the engine's next report counts it
            if self.request_timeout is not None:
                channel.timer = channel.loop.call_later(self.request_timeout, self._expire, request_id)
            self._channels[request_id] = channel
        else:
            self._channels[request_id] = channel
            self._pending_adds += 1
            self._post(("add", request_id, prompt, params, images))
        finished = False
        try:
            while True:
                item = await channel.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if channel.timer is not None:
                channel.timer.cancel()
            if not finished:
                reason = channel.ended_by_consumer or "abort"
                if self.loop_driven:
                    self._end(request_id, reason)
                else:
                    self._post(("end", request_id, reason))
            self._channels.pop(request_id, None)

    def finish(self, request_id: str, reason: str = "stop") -> None:
        """The consumer of a stream has completed its request (the protocol parser found a stop string): when the
        stream is closed, the engine ends the request with ``reason`` and the metrics count it so, not as an
        abort. Call it before leaving the iteration; unknown ids are ignored."""
        channel = self._channels.get(request_id)
        if channel is not None:
            channel.ended_by_consumer = reason

    def cut_all(self, message: str) -> None:
        """End every request now (the drain deadline passed): each stream gets ``ServerShuttingDownError``.
        Any thread may call it."""
        if not self.loop_driven:
            self._post(("cut", message))
        elif self._loop is None or self._loop.is_closed():
            self._shutdown_message = message  # nothing in flight: no stream was ever read
        else:
            self._loop.call_soon_threadsafe(self._cut_all, message)

    # ---- an engine in other processes, read in the event loop ------------------------------------
    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """A wake-up's reports (usually one step's), on the event loop: counters first, then every stream."""
        self._pending_adds = 0
        self._update_gauges()
        self._deliver_outputs(outputs, in_loop=True)

    def _on_engine_failure(self, failure: str) -> None:
        log.error("engine failed: %s", failure)
        self.alive = False
        for channel in list(self._channels.values()):
            channel.queue.put_nowait(EngineDeadError(f"the engine failed: {failure}"))

    def _expire(self, request_id: str) -> None:
        channel = self._channels.get(request_id)
        if channel is not None and self.engine.unfinished_completions(request_id):
            self.engine.abort(request_id)
            channel.queue.put_nowait(
                RequestTimeoutError(f"request exceeded --request-timeout ({self.request_timeout} s)")
            )
            self.metrics.finished("timeout").inc()

    def _post(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.05)
                self._wake.clear()
                self._apply_commands()
                self._expire_overdue()
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._update_gauges()  # first: a client that has its last token sees the step's counters
                    self._deliver_outputs(outputs)
                else:
                    self._update_gauges()
        except Exception as exc:  # an engine bug: fail every request loudly, report unhealthy
            log.exception("engine thread failed")
            self.alive = False
            for channel in list(self._channels.values()):
                self._send(channel, EngineDeadError(f"the engine failed: {exc}"))

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind, request_id = command[0], command[1]
            if kind == "cut":
                self._cut_all(command[1])
            elif kind == "add":
                self._pending_adds -= 1
                channel = self._channels.get(request_id)
                if channel is None:
                    continue  # the client left before the request started
                if self._shutdown_message is not None:
                    self._send(channel, ServerShuttingDownError(self._shutdown_message))
                    continue
                try:
                    self.engine.add_request(command[2], command[3], request_id=request_id, images=command[4])
                except ValueError as exc:
                    self._send(channel, exc)
            elif kind == "end":  # the client left before the end, or its consumer completed it
                self._end(request_id, command[2])

    def _end(self, request_id: str, reason: str) -> None:
        """End a request early (``abort``, or the consumer's reason), counting each unfinished completion as
        finished ones are counted."""
        self.metrics.finished(reason).inc(self.engine.unfinished_completions(request_id))
        if reason == "abort":
            self.engine.abort(request_id)
        else:
            self.engine.finish(request_id, reason)

    def _cut_all(self, message: str) -> None:
        self._shutdown_message = message
        for request_id, channel in list(self._channels.items()):
            if self.engine.unfinished_completions(request_id):
                self._end(request_id, "abort")
                error = ServerShuttingDownError(message)
                channel.queue.put_nowait(error) if self.loop_driven else self._send(channel, error)

    def _expire_overdue(self) -> None:
        now = time.monotonic()
        for request_id, channel in list(self._channels.items()):
            overdue = channel.deadline is not None and now > channel.deadline
            if overdue and self.engine.unfinished_completions(request_id):
                self.engine.abort(request_id)
                self._send(
                    channel, RequestTimeoutError(f"request exceeded --request-timeout ({self.request_timeout} s)")
                )
                self.metrics.finished("timeout").inc()

    def _deliver_outputs(self, outputs: list[RequestOutput], in_loop: bool = False) -> None:
        """Count the step's tokens and hand every output to its request's channel: from the engine thread with one
        wake-up of the event loop for the whole step (a wake-up per request made the loop take the Python lock
        once per stream), or straight into the queues when called in the loop (``in_loop``)."""
        m, now = self.metrics, time.monotonic()
        deliveries: list[tuple[_Channel, RequestOutput]] = []
        new_tokens = 0
        for output in outputs:
            channel = self._channels.get(output.request_id)
            for completion in output.outputs:
                seen = channel.tokens_seen.get(completion.index, 0) if channel else 0
                count = len(completion.token_ids)
                if channel and count > seen:
                    last = channel.last_token_time.get(completion.index)
                    if last is not None:
                        m.series.itl.observe(now - last)
                    channel.last_token_time[completion.index] = now
                    channel.tokens_seen[completion.index] = count
                new_tokens += max(0, count - seen)
            if output.finished:
                self._record_finished(output)
            if channel is not None:
                deliveries.append((channel, output))
        m.series.generation_tokens.inc(new_tokens)
        if in_loop:
            for channel, item in deliveries:
                channel.queue.put_nowait(item)
        else:
            self._send_all(deliveries)

    def _record_finished(self, output: RequestOutput) -> None:
        m, metrics = self.metrics, output.metrics
        m.series.prompt_tokens.inc(len(output.prompt_token_ids))
        for completion in output.outputs:
            m.finished(completion.finish_reason or "unknown").inc()
        if metrics.time_to_first_token is not None:
            m.series.ttft.observe(metrics.time_to_first_token)
        if metrics.latency is not None:
            m.series.e2e.observe(metrics.latency)
        if metrics.queue_time is not None:
            m.series.queue_time.observe(metrics.queue_time)

    def _update_gauges(self) -> None:
        m, load = self.metrics, self.engine.load()
        m.series.running.set(load.running)
        m.series.waiting.set(load.waiting)
        m.series.blocks_in_use.set(load.blocks_used)
        m.series.cache_usage.set(load.cache_usage)
        m.series.prefix_queries.inc(load.prefix_queries - self._exported_prefix[0])
        m.series.prefix_hits.inc(load.prefix_hits - self._exported_prefix[1])
        self._exported_prefix = (load.prefix_queries, load.prefix_hits)
        stats = load.spec_stats
        if stats is not None:
            done = self._exported_spec
            m.series.spec_drafts.inc(stats.num_drafts - done.num_drafts)
            m.series.spec_draft_tokens.inc(stats.num_draft_tokens - done.num_draft_tokens)
            m.series.spec_accepted.inc(stats.num_accepted_tokens - done.num_accepted_tokens)
            for position, count in enumerate(stats.accepted_per_position):
                before = done.accepted_per_position[position] if position < len(done.accepted_per_position) else 0
                m.accepted_at(position).inc(count - before)
            self._exported_spec = replace(stats, accepted_per_position=list(stats.accepted_per_position))
        if load.expert_offload is not None:
            self._export_offload(load.expert_offload)

    def _export_offload(self, traffic: OffloadTraffic) -> None:
        """Add the expert-offload counters' growth since the last export; set the resident / offloaded gauges."""
        series, done = self.metrics.offload_series(), self._exported_offload
        for name in OFFLOAD_COUNTERS:
            series[name].inc(max(0, getattr(traffic, name) - getattr(done, name)))
        for name in OFFLOAD_GAUGES:
            series[name].set(getattr(traffic, name))
        self._exported_offload = traffic

    @staticmethod
    def _send(channel: _Channel, item) -> None:
        channel.loop.call_soon_threadsafe(channel.queue.put_nowait, item)

    @staticmethod
    def _send_all(deliveries: list[tuple[_Channel, RequestOutput]]) -> None:
        """Post each loop one callback that fills all of its channels (one wake-up per loop, not per channel)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for channel, item in deliveries:
            by_loop.setdefault(channel.loop, []).append((channel.queue, item))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for channel_queue, item in items:
        channel_queue.put_nowait(item)
