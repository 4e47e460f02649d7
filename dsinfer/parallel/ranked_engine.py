"""The API process's engine when the engine runs in processes: it starts them, routes requests, gathers outputs.

Several ranks always run in processes of their own; one rank does by default under ``dsinfer serve`` (one
engine process, :class:`~dsinfer.parallel.engine_loop.EngineProcessLoop`), so that the server's HTTP work and
the engine's step never share a Python lock. :class:`RankedEngine` answers the calls :class:`~dsinfer.llm.LLM` and
:class:`~dsinfer.server.async_engine.AsyncEngine` make of any engine (:class:`~dsinfer.engine.client.EngineClient`:
requests in, outputs out, the ranks' counters summed by ``load()``), so both drive an engine in-process or in
processes alike. Requests are checked here (token ids, length, images) and sent to the rank
:class:`~dsinfer.parallel.dp.RequestBalancer` picks; ``step`` returns the outputs the ranks reported since the last
call, rebuilt from their token deltas (text and stop strings: :mod:`dsinfer.engine.output_processor`).

A request crosses the pipe once as its specification; each step comes back as one message holding every
request's new tokens and the engine's counters (:class:`~dsinfer.parallel.messages.StepReport`).

The ranks send token ids only (with logprobs, finish reasons and timings): text, incremental detokenization and
stop strings live here, as vLLM's frontend detokenizes what its EngineCore reports. A stop string found here ends
the completion in the rank too (``FinishSequence``, or ``AbortRequest`` once every completion has ended).

The API server reads the pipes in its event loop (:meth:`RankedEngine.attach`: one wake-up per report, handled as
it arrives, no thread between the pipe and the streams); ``step`` (the offline :class:`~dsinfer.llm.LLM`) starts a
receiver thread instead. Either watches every local rank process. A rank that exits, fails or closes its
connection makes the engine dead: every rank is killed (the others would wait in a collective forever), and the
next ``step`` / ``has_unfinished_requests`` raises :class:`RankDiedError` naming the rank (an attached loop is
told at once).
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import threading
import time
from dataclasses import dataclass, fields, replace
from multiprocessing.connection import Connection, Listener, wait

from dsinfer import envs
from dsinfer.config import ConfigError, EngineConfig, ModelConfig
from dsinfer.engine.client import EngineLoad
from dsinfer.engine.output_processor import ReportedCompletion, request_output
from dsinfer.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from dsinfer.engine.request_check import RequestChecker
from dsinfer.offload.traffic import OffloadTraffic
from dsinfer.parallel import messages
from dsinfer.parallel.config import ParallelConfig
from dsinfer.parallel.dp import RequestBalancer
from dsinfer.parallel.ep import ExpertPlacement
from dsinfer.parallel.messages import FrameReader, FrameWriter, RankFailed, RankLoad, RankReady, RankSpec
from dsinfer.parallel.rank_main import RANK_AUTHKEY_ENV, rank_main
from dsinfer.sampling_params import SamplingParams
from dsinfer.speculative.executor import SpeculativeStats
from dsinfer.tokenizer import Tokenizer

log = logging.getLogger("dsinfer.parallel")

STARTUP_TIMEOUT_SECONDS = 600.0
SHUTDOWN_TIMEOUT_SECONDS = 30.0
PEER_EXIT_GRACE_SECONDS = 0.5  # a rank failing in a collective waits this long for the peer that left to show


def rank_context(device: str):
    """CPU ranks fork from a server process that imported the model code once (:mod:`dsinfer.parallel.warm`),
    which saves seconds per rank; GPU ranks start fresh interpreters, so nothing CUDA-related is inherited."""
    if device.startswith("cuda"):
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["dsinfer.parallel.warm"])
    return context


class RankDiedError(RuntimeError):
    """A rank process exited or failed; the engine cannot step any more."""


def check_layout(parallel: ParallelConfig, model_config: ModelConfig, engine: EngineConfig) -> None:
    """Every layout check that needs no weights: experts over EP, GPUs per host, the placement file."""
    parallel.check_model(model_config.n_routed_experts)
    if engine.device.startswith("cuda"):
        import torch

        parallel.check_devices(engine.device, torch.cuda.device_count())
    if parallel.expert_placement:
        ExpertPlacement.from_file(
            parallel.expert_placement, model_config.n_routed_experts, parallel.expert_parallel_size
        )


@dataclass
class _EngramVocabulary:
    """What the prompt check reads of V4.1's Engram hasher (it lives in the ranks): the token ids it maps."""

    vocab_size: int


@dataclass
class _ModelInfo:
    """The model as the API process knows it (its weights live in the ranks)."""

    config: ModelConfig


@dataclass
class _Attached:
    """An event loop that reads the ranks' pipes (:meth:`RankedEngine.attach`)."""

    loop: object
    deliver: object
    failed: object
    readers: dict[int, FrameReader]


@dataclass
class _Tracked:
    rank: int
    prompt_token_ids: list[int]
    completions: list[ReportedCompletion]
    tokens: int  # counted in the balancer's in-flight tokens
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)


_TOTALLED_APART = ("spec_stats", "expert_offload")
_SUMMED_LOAD_FIELDS = tuple(f.name for f in fields(EngineLoad) if f.name not in _TOTALLED_APART)  # RankLoad has all


def total_load(loads: dict[int, RankLoad]) -> EngineLoad:
    """The engine's counters summed over its ranks' last reports (speculative decoding's totals too: each DP
    rank drafts and verifies its own requests)."""
    reports = list(loads.values())
    totals = {name: sum(getattr(load, name) for load in reports) for name in _SUMMED_LOAD_FIELDS}
    return EngineLoad(**totals, spec_stats=SpeculativeStats.total(load.spec_stats for load in reports),
                      expert_offload=OffloadTraffic.total(load.expert_offload for load in reports))  # fmt: skip


class RankedEngine:
    """The engine in processes of its own; it answers :class:`~dsinfer.engine.client.ReportingEngineClient`'s
    calls (``attach`` reads the ranks' reports in an event loop; ``step`` in a receiver thread)."""

    def __init__(
        self,
        model_dir: str,
        tokenizer: Tokenizer,
        model_config: ModelConfig,
        config: EngineConfig,
        parallel: ParallelConfig,
        log_level: str = "WARNING",
        load_format: str = "auto",
    ) -> None:
        check_layout(parallel, model_config, config)
        self.tokenizer, self.config, self.parallel = tokenizer, config, parallel
        self.model = _ModelInfo(model_config)
        self.max_model_len = config.resolved_max_model_len(model_config)
        self._tracked: dict[str, _Tracked] = {}
        self._loads: dict[int, RankLoad] = {}
        self.failure: str | None = None
        self._closing = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._conns: dict[int, Connection] = {}
        self._processes: dict[int, multiprocessing.Process] = {}
        try:
            self._start_ranks(model_dir, log_level, load_format)
            ready = self._wait_ready()
        except BaseException:
            self._kill_ranks()
            raise
        first = ready[0]
        log.info("%d ranks ready (%s)", len(ready), first.placement)
        # Every rank's entry exists before the receiver thread updates them (load() sums over them meanwhile).
        self._loads.update({r.rank: RankLoad(num_blocks=r.num_blocks) for r in ready})
        # Every message to a rank goes through its writer: never lost on a full pipe, never blocking an attached loop.
        self._writers = {rank: FrameWriter(conn) for rank, conn in self._conns.items()}
        engram = None if first.engram_vocab_size is None else _EngramVocabulary(first.engram_vocab_size)
        self.checker = RequestChecker(tokenizer, model_config, self.max_model_len, engram)
        self.balancer = RequestBalancer(parallel.world_size, first.block_tokens, config.step_token_budget)
        # Reports are read by a receiver thread (``step``) or in an asyncio event loop (``attach``), never both.
        self._receiver: threading.Thread | None = None
        self._attached: _Attached | None = None

    # ---- ranks -------------------------------------------------------------------------------------
    def _start_ranks(self, model_dir: str, log_level: str, load_format: str) -> None:
        # One engine process needs no rendezvous (it joins no process group).
        port = self.parallel.resolved_master_port() if self.parallel.is_multi_rank else 0
        context = rank_context(self.config.device)
        for rank in self.parallel.local_ranks:
            spec = RankSpec(str(model_dir), self.config, self.parallel, rank, port, log_level, load_format)
            ours, theirs = context.Pipe()
            name = f"dsinfer-rank-{rank}" if self.parallel.is_multi_rank else "dsinfer-engine"
            process = context.Process(target=rank_main, args=(spec, theirs), name=name, daemon=True)
            process.start()
            theirs.close()
            self._conns[rank], self._processes[rank] = ours, process
        remote = self.parallel.world_size - len(self._processes)
        if remote:
            self._accept_remote_ranks(port + 1, remote)

    def _accept_remote_ranks(self, port: int, count: int) -> None:
        """Ranks of the other hosts connect to ``--master-addr``:``--master-port + 1`` with the shared key."""
        key = envs.RANK_AUTHKEY.get()
        if not key:
            raise ConfigError(f"--nnodes > 1: set ${RANK_AUTHKEY_ENV} to the same secret on every host")
        listener = Listener(("0.0.0.0", port), authkey=key.encode())
        pending: list[Connection] = []
        try:
            for _ in range(count):
                pending.append(listener.accept())
        finally:
            listener.close()
        self._remote_pending = pending

    def _wait_ready(self) -> list[RankReady]:
        ready: dict[int, RankReady] = {}
        pending = list(getattr(self, "_remote_pending", []))
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while len(ready) < self.parallel.world_size:
            waitables = [*self._conns.values(), *pending, *(p.sentinel for p in self._processes.values())]
            if not wait(waitables, timeout=max(0.0, deadline - time.monotonic())):
                raise RankDiedError(f"ranks {sorted(set(range(self.parallel.world_size)) - set(ready))} did not start")
            for conn in [*self._conns.values(), *pending]:
                if not conn.poll():
                    continue
                try:
                    message = conn.recv()
                except EOFError:
                    continue  # its process sentinel says why
                if isinstance(message, RankFailed):
                    if message.error is not None and not self.parallel.is_multi_rank:
                        raise message.error  # what the engine would raise in-process (a ConfigError, ...)
                    raise RankDiedError(f"rank {message.rank} failed while starting: {message.message}")
                if isinstance(message, RankReady):
                    ready[message.rank] = message
                    if conn in pending:
                        pending.remove(conn)
                        self._conns[message.rank] = conn
            for rank, process in self._processes.items():  # after the messages: a failure says why first
                if not process.is_alive() and rank not in ready:
                    raise RankDiedError(f"rank {rank} exited with code {process.exitcode} while starting")
        return [ready[r] for r in sorted(ready)]

    def attach(self, loop, deliver, failed) -> None:
        """Read the ranks' reports in ``loop`` (the API server's event loop) instead of a receiver thread: each
        time a pipe has data, the whole reports it holds are applied at once and ``deliver`` gets their outputs
        (one call per wake-up, what ``step`` would have returned); a rank that fails, closes its pipe or exits
        calls ``failed`` with the reason, once. Call from ``loop``'s thread; a second call moves to a new loop."""
        if self._receiver is not None:
            raise RuntimeError("the reports are already read by step()'s receiver thread")
        self.detach()
        # The readers outlive a move to another loop: one may hold the first part of a report.
        readers = getattr(self, "_readers", None) or {rank: FrameReader(conn) for rank, conn in self._conns.items()}
        self._readers = readers
        attached = _Attached(loop, deliver, failed, readers)
        self._attached = attached
        for rank, reader in attached.readers.items():
            loop.add_reader(reader.fileno(), self._on_readable, rank, reader)
        for writer in self._writers.values():
            writer.attach(loop)
        for rank, process in self._processes.items():
            loop.add_reader(process.sentinel, self._on_exit, rank)
        if self.failure is not None:
            self._detach_and_report(self.failure)

    def detach(self) -> None:
        """Stop reading in the attached loop (a loop already closed has nothing left to remove)."""
        attached, self._attached = self._attached, None
        if attached is None:
            return
        if not attached.loop.is_closed():
            for reader in attached.readers.values():
                attached.loop.remove_reader(reader.fileno())
            for process in self._processes.values():
                attached.loop.remove_reader(process.sentinel)
        for writer in self._writers.values():
            writer.detach()  # blocking again, for step()'s thread and close(); what was pending is written first

    def _on_readable(self, rank: int, reader: FrameReader) -> None:
        try:
            reports = reader.read()
        except (EOFError, OSError):
            self._fail(*self._first_to_go(rank, "closed its connection"))
            return
        outputs: dict[str, RequestOutput] = {}
        for message in reports:
            if isinstance(message, RankFailed):
                self._fail(*self._first_to_go(rank, f"failed: {message.message}"))
                return
            self._loads[message.rank] = message.load
            self._apply_report(message, outputs)
        attached = self._attached
        if attached is not None and reports:
            attached.deliver(list(outputs.values()))

    def _on_exit(self, rank: int) -> None:
        if not self._closing:
            self._fail(*self._first_to_go(rank, f"exited with code {self._processes[rank].exitcode}"))

    def _detach_and_report(self, failure: str) -> None:
        attached = self._attached
        self.detach()
        if attached is not None:
            attached.failed(failure)

    def _receive(self) -> None:
        """Forward every rank's reports to the inbox; the first rank that goes away ends them all."""
        ranks_of = {conn: rank for rank, conn in self._conns.items()}
        ranks_of.update({p.sentinel: rank for rank, p in self._processes.items()})
        while not self._closing:
            for item in wait(list(ranks_of), timeout=0.2):
                rank = ranks_of[item]
                if isinstance(item, Connection):
                    try:
                        message = item.recv()
                    except (EOFError, OSError):
                        self._fail(*self._first_to_go(rank, "closed its connection"))
                        return
                    if isinstance(message, RankFailed):
                        self._fail(*self._first_to_go(rank, f"failed: {message.message}"))
                        return
                    # The counters now, not when the engine thread next steps: an idle server still shows them.
                    self._loads[message.rank] = message.load
                    self._inbox.put(message)
                elif not self._closing:
                    self._fail(*self._first_to_go(rank, f"exited with code {self._processes[rank].exitcode}"))
                    return

    def _first_to_go(self, rank: int, what: str) -> tuple[int, str]:
        """The rank to blame when ``rank`` fails or hangs up: a peer whose process exited unasked within a moment
        (a rank killed mid-collective makes the others fail too, sometimes before its own exit is seen)."""
        others = {p.sentinel: r for r, p in self._processes.items() if r != rank}
        if not others or self._processes.get(rank) is None or self._processes[rank].exitcode not in (None, 1):
            return rank, what  # one rank, a remote rank, or one that was killed or crashed: it is the news
        # A rank that failed in a collective reports and exits 1; the peer that left exits otherwise.
        for sentinel in wait(list(others), timeout=PEER_EXIT_GRACE_SECONDS):
            code = self._processes[others[sentinel]].exitcode
            if code != 1:
                return others[sentinel], f"exited with code {code}"
        return rank, what

    def _fail(self, rank: int, what: str) -> None:
        if self._closing:
            return
        process = self._processes.get(rank)
        pid = f" (pid {process.pid})" if process is not None else ""
        who = f"rank {rank}" if self.parallel.is_multi_rank else "the engine process"
        self.failure = f"{who}{pid} {what}"
        log.error("%s; stopping every rank", self.failure)
        self._kill_ranks()
        self._inbox.put(None)
        self._detach_and_report(self.failure)

    def _kill_ranks(self) -> None:
        for process in self._processes.values():
            if process.is_alive():
                process.kill()
        for process in self._processes.values():
            process.join(timeout=5)

    # ---- what LLM and AsyncEngine call -------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, images: list | None = None) -> str:  # fmt: skip
        """Check the request here (bad input raises ``ValueError``), then send it to the least busy rank."""
        self._check_alive()
        request = self.checker.check(prompt, params, request_id, images, self._tracked)
        request_id, params, prompt_ids = request.request_id, request.params, request.prompt_token_ids
        rank = self.balancer.choose(prompt_ids)
        tokens = len(prompt_ids) * params.n
        completions = [ReportedCompletion(self.tokenizer, params, i) for i in range(params.n)]
        self._tracked[request_id] = _Tracked(rank, prompt_ids, completions, tokens)
        self.balancer.assign(rank, prompt_ids, tokens)
        # Text is made here only: the rank sends token ids, this process detokenizes and applies stop strings.
        rank_params = replace(params, stop=[], detokenize=False) if params.stop or params.detokenize else params
        self._send(rank, messages.AddRequest(request_id, prompt_ids, rank_params, request.images))
        for other in self._conns:
            if other != rank:
                self._send(other, messages.Wake())
        return request_id

    def abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self.balancer.release(tracked.rank, tracked.tokens)
        if self.failure is None:
            self._send(tracked.rank, messages.AbortRequest(request_id))

    def finish(self, request_id: str, reason: str = "stop") -> None:
        """End a request its consumer completed: the ranks free it as for an abort (they report nothing more of
        it, so the reason matters only to the caller, which counts it)."""
        self.abort(request_id)

    @property
    def requests(self) -> dict[str, list[CompletionOutput]]:
        """The requests in flight, each with its completions so far (a copy: this process keeps its own)."""
        return {rid: [c.snapshot() for c in t.completions] for rid, t in list(self._tracked.items())}

    def unfinished_completions(self, request_id: str) -> int:
        tracked = self._tracked.get(request_id)
        return 0 if tracked is None else sum(not c.finished for c in tracked.completions)

    def load(self) -> EngineLoad:
        return total_load(self._loads)

    def has_unfinished_requests(self) -> bool:
        self._check_alive()
        return bool(self._tracked)

    def step(self, timeout: float = 0.05) -> list[RequestOutput]:
        """The outputs the ranks reported since the last call (waits up to ``timeout`` for the first)."""
        self._check_alive()
        if self._receiver is None:
            if self._attached is not None:
                raise RuntimeError("the reports are read in an event loop (attach): step() has none")
            self._receiver = threading.Thread(target=self._receive, name="dsinfer-ranks", daemon=True)
            self._receiver.start()
        try:
            reports = [self._inbox.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                reports.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        outputs: dict[str, RequestOutput] = {}
        for report in reports:
            if report is None:
                self._check_alive()
            self._apply_report(report, outputs)
        return list(outputs.values())

    def close(self) -> None:
        """Stop every rank (they finish the iteration in progress together). Idempotent."""
        if self._closing:
            return
        self._closing = True
        self.detach()
        for reader in getattr(self, "_readers", {}).values():
            reader.close()
        for rank in self._conns:
            self._send(rank, messages.Shutdown())
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_SECONDS
        for process in self._processes.values():
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [rank for rank, p in self._processes.items() if p.is_alive()]
        if stuck:
            log.error("ranks %s did not stop within %.0f s; killing them", stuck, SHUTDOWN_TIMEOUT_SECONDS)
        self._kill_ranks()
        for conn in self._conns.values():
            conn.close()

    @property
    def spec_stats(self) -> SpeculativeStats | None:
        """Speculative decoding's totals over the ranks as they last reported them (None: not speculating)."""
        return total_load(self._loads).spec_stats

    @property
    def pids(self) -> dict[int, int]:
        """The process id of each rank this host started."""
        return {rank: process.pid for rank, process in self._processes.items()}

    @property
    def rank_loads(self) -> dict[int, RankLoad]:
        """Each rank's counters as it last reported them."""
        return dict(self._loads)

    @property
    def exit_failure(self) -> str | None:
        return self.failure

    # ---- internals ---------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.failure is not None:
            raise RankDiedError(self.failure)

    def _send(self, rank: int, message) -> None:
        try:
            self._writers[rank].send(message)
        except OSError:
            pass  # the receiver thread (or the attached loop) reports the rank that went away

    def _apply_report(self, report: messages.StepReport, outputs: dict[str, RequestOutput]) -> None:
        for request_id, message in report.rejected:
            log.warning("rank %d rejected request %s: %s", report.rank, request_id, message)
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                for completion in tracked.completions:
                    completion.output.finish_reason = "abort"
                outputs[request_id] = self._finish(request_id, tracked)
        for delta in report.deltas:
            tracked = self._tracked.get(delta.request_id)
            if tracked is None:
                continue  # aborted here while the rank ran it
            self._apply_delta(delta.request_id, tracked, delta)
            if tracked.finished:
                if not delta.finished:  # stop strings ended it here: the rank still holds it
                    self._send(tracked.rank, messages.AbortRequest(delta.request_id))
                    tracked.metrics = replace(tracked.metrics, finish_time=time.monotonic())
                outputs[delta.request_id] = self._finish(delta.request_id, tracked)
            else:
                outputs[delta.request_id] = self._output(delta.request_id, tracked)

    def _apply_delta(self, request_id: str, tracked: _Tracked, delta: messages.RequestDelta) -> None:
        """The rank's new tokens, one by one through detokenization and the stop strings."""
        tracked.metrics = delta.metrics
        for change in delta.completions:
            completion = tracked.completions[change.index]
            last = len(change.new_token_ids) - 1
            for i, token in enumerate(change.new_token_ids):
                stopped = completion.push(
                    token, change.finish_reason if i == last else None, change.hide_last_token and i == last,
                    change.new_logprobs[i] if change.new_logprobs is not None else None,
                    change.new_top_logprobs[i] if change.new_top_logprobs is not None else None,
                )  # fmt: skip
                if stopped and not tracked.finished:
                    self._send(tracked.rank, messages.FinishSequence(request_id, change.index))  # the others go on
            self.balancer.inflight_tokens[tracked.rank] += len(change.new_token_ids)
            tracked.tokens += len(change.new_token_ids)

    def _output(self, request_id: str, tracked: _Tracked) -> RequestOutput:
        metrics = tracked.metrics or RequestMetrics(time.monotonic(), None, None, None)
        completions = [c.snapshot() for c in tracked.completions]
        return request_output(request_id, tracked.prompt_token_ids, completions, metrics)

    def _finish(self, request_id: str, tracked: _Tracked) -> RequestOutput:
        output = self._output(request_id, tracked)
        self._tracked.pop(request_id, None)
        self.balancer.release(tracked.rank, tracked.tokens)
        return output


def run_remote_ranks(model_dir: str | None, config: EngineConfig, parallel: ParallelConfig) -> int:
    """A host other than host 0: start its ranks, which reach host 0's API process, and wait for them.

    Exits 0 when every rank stopped cleanly (host 0 shut down), else 1 after ending the others."""
    from dsinfer.models.tiny import default_model_dir

    model_dir = str(model_dir or default_model_dir())
    check_layout(parallel, ModelConfig.from_file(model_dir), config)
    if not envs.RANK_AUTHKEY.get():
        raise ConfigError(f"--nnodes > 1: set ${RANK_AUTHKEY_ENV} to the same secret on every host")
    context = rank_context(config.device)
    processes = {}
    for rank in parallel.local_ranks:
        spec = RankSpec(model_dir, config, parallel, rank, parallel.resolved_master_port())
        processes[rank] = context.Process(target=rank_main, args=(spec, None), name=f"dsinfer-rank-{rank}")
        processes[rank].start()
    status = 0
    try:
        while any(p.is_alive() for p in processes.values()):
            wait([p.sentinel for p in processes.values() if p.is_alive()])
            failed = [rank for rank, p in processes.items() if p.exitcode not in (None, 0)]
            if failed:
                log.error("rank %d exited with code %s; stopping this host's ranks", failed[0],
                          processes[failed[0]].exitcode)  # fmt: skip
                status = 1
                break
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
    return status
