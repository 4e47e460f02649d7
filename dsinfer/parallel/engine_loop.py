"""An engine process's side of the pipe, and the loop of the one engine process that serves a single rank.

:class:`EngineLoop` is what every engine process does with the API process's messages: it adds, aborts and
finishes requests on its :class:`~dsinfer.engine.engine.LLMEngine`, and turns each step's outputs into the token
deltas the API process rebuilds text from (:mod:`dsinfer.engine.output_processor`). The ranks of a multi-rank layout
(:mod:`dsinfer.parallel.rank_main`) and the one engine process share it.

:class:`EngineProcessLoop` is ``dsinfer serve``'s default with one rank, like vLLM V1's EngineCore: the engine
steps in a process of its own, so the server's HTTP and asyncio work never waits for the engine's Python lock,
nor the engine's step for theirs. With no peers it needs no process group and no per-step exchange: it blocks on
its pipe while idle and otherwise runs the engine exactly as the API process would (overlap scheduling with the
device worker, CUDA graphs, speculative decoding, V4.1 eager or not), reporting after every step.
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.engine.gc_heap import freeze_heap
from dsinfer.engine.outputs import RequestOutput
from dsinfer.models.dummy import build_dummy_model
from dsinfer.models.loader import load_model
from dsinfer.models.small_cpu_weights import dequantize_experts_, is_small_cpu_checkpoint, small_cpu_fp8_linears
from dsinfer.offload.install import offload_experts
from dsinfer.offload.random_experts import offload_dummy_experts
from dsinfer.offload.traffic import poll_offload_traffic
from dsinfer.parallel.messages import (
    AbortRequest,
    AddRequest,
    CompletionDelta,
    FinishSequence,
    RankLoad,
    RankReady,
    RankSpec,
    RequestDelta,
    Shutdown,
    StepReport,
)
from dsinfer.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# An idle engine process blocks on its pipe this long at a time: a message wakes it at once, and a parent that
# dies is noticed by the parent watch (dsinfer.parallel.rank_main), so this only bounds one idle wait.
IDLE_WAIT_SECONDS = 1.0


def load_engine_model(model_dir: str | Path, config: EngineConfig, load_format: str = "auto"):
    """The whole model as one process serves it: the checkpoint's weights, or random ones (``load_format``
    'dummy'). Shared by the in-process :class:`~dsinfer.llm.LLM` and the one engine process."""
    offloading = config.expert_offload is not None
    expert_device = "meta" if offloading else None  # offloaded experts: each read once, where it is placed
    if load_format == "dummy":  # random experts, drawn where the offload keeps them
        model = build_dummy_model(model_dir, DTYPES[config.dtype], config.device, expert_device=expert_device)
        return offload_dummy_experts(model, config) if offloading else model
    small = expert_device is None and is_small_cpu_checkpoint(model_dir, config.device)
    model = load_model(
        model_dir, dtype=DTYPES[config.dtype], device=config.device, progress=False,
        engram_placement=config.engram_placement, expert_device=expert_device,
        fp8_linears=small_cpu_fp8_linears(model_dir, config.device) if small else None,
    )  # fmt: skip
    if small:  # per-step dequantising was most of a small model's CPU step
        dequantize_experts_(model, DTYPES[config.dtype])
    return offload_experts(model, config)


class EngineLoop:
    """Messages in, token deltas out, for one :class:`LLMEngine` in an engine process."""

    def __init__(self, spec: RankSpec, conn: Connection, model, engine: LLMEngine) -> None:
        self.spec, self.conn, self.rank = spec, conn, spec.rank
        self.model, self.engine = model, engine
        self._sent: dict[tuple[str, int], int] = {}  # tokens already reported per completion
        self._sequences: dict[str, list] = {}  # a request's sequences (the engine forgets finished ones)
        self._stop = False
        self._sent_traffic = None  # the expert-offload traffic of the last report

    def send_ready(self, placement: str) -> None:
        hasher = getattr(self.model, "engram_hasher", None)
        engine, vocab = self.engine, hasher.vocab_size if hasher is not None else None
        ready = RankReady(self.rank, os.getpid(), engine.max_model_len, engine.blocks.num_blocks,
                          engine.runner.block_tokens, placement, vocab)  # fmt: skip
        freeze_heap()  # this process serves its engine until it exits: full collections skip the start-up heap
        self.conn.send(ready)

    def close(self) -> None:
        """Stop the engine (a step in flight finishes), then release V4.1's Engram tables."""
        self.engine.close()
        self.model.close()

    def _take_messages(self, timeout: float, report: StepReport) -> bool:
        """Apply what the API process sent; True when anything arrived."""
        arrived = False
        try:
            if not self.conn.poll(timeout):
                return False
            while self.conn.poll():
                arrived = True
                self._apply(self.conn.recv(), report)
        except (EOFError, OSError):  # the API process is gone: stop (with everyone else)
            self._stop = True
        return arrived

    def _apply(self, message, report: StepReport) -> None:
        if isinstance(message, AddRequest):
            try:
                self.engine.add_request(
                    message.prompt_token_ids, message.params, request_id=message.request_id,
                    images=list(message.images) or None,
                )  # fmt: skip
                self._sequences[message.request_id] = self.engine.requests[message.request_id]
            except ValueError as exc:
                report.rejected.append((message.request_id, str(exc)))
        elif isinstance(message, AbortRequest):
            self.engine.abort(message.request_id)
            self._sequences.pop(message.request_id, None)
            for key in [key for key in self._sent if key[0] == message.request_id]:
                del self._sent[key]
        elif isinstance(message, FinishSequence):
            sequences = self._sequences.get(message.request_id, [])
            if message.index < len(sequences) and not sequences[message.index].is_finished:
                self.engine.scheduler.finish(sequences[message.index])
                sequences[message.index].finish_reason = "stop"
        elif isinstance(message, Shutdown):
            self._stop = True

    def _delta(self, output: RequestOutput) -> RequestDelta:
        """What changed in ``output`` since the last report (the API process keeps the rest)."""
        completions = []
        sequences = self._sequences.get(output.request_id, [])
        for completion in output.outputs:
            key = (output.request_id, completion.index)
            sent = self._sent.get(key, 0)
            if len(completion.token_ids) == sent:
                continue
            hidden = completion.index < len(sequences) and sequences[completion.index].hide_last_token
            completions.append(
                CompletionDelta(
                    completion.index,
                    completion.token_ids[sent:],
                    completion.finish_reason,
                    bool(hidden) and completion.finish_reason is not None,
                    completion.logprobs[sent:] if completion.logprobs is not None else None,
                    completion.top_logprobs[sent:] if completion.top_logprobs is not None else None,
                )
            )
            self._sent[key] = len(completion.token_ids)
        if output.finished:
            self._sequences.pop(output.request_id, None)
            for completion in output.outputs:
                self._sent.pop((output.request_id, completion.index), None)
        return RequestDelta(output.request_id, completions, output.finished, output.metrics)

    def _load(self, **extra) -> RankLoad:
        engine = self.engine
        self._sent_traffic = poll_offload_traffic(self.model)
        return RankLoad(
            len(engine.scheduler.waiting), len(engine.scheduler.running), engine.blocks.num_used,
            engine.blocks.num_blocks, engine.blocks.prefix_queries, engine.blocks.prefix_hits,
            engine.scheduler.num_preemptions, spec_stats=engine.spec_stats, expert_offload=self._sent_traffic,
            **extra,
        )  # fmt: skip

    def offload_traffic_moved(self) -> bool:
        """While idle: the expert-offload counters differ from the last report (on CUDA they lag by a poll, so
        the last step's counts arrive with an idle report)."""
        return self._sent_traffic is not None and poll_offload_traffic(self.model) != self._sent_traffic


class EngineProcessLoop(EngineLoop):
    """The one engine process of a single rank: the whole model, the engine as configured."""

    def __init__(self, spec: RankSpec, conn: Connection) -> None:
        model = load_engine_model(spec.model_dir, spec.engine, spec.load_format)
        try:
            engine = LLMEngine(model, Tokenizer.from_dir(spec.model_dir), spec.engine)
        except BaseException:
            model.close()
            raise
        super().__init__(spec, conn, model, engine)
        self.send_ready("one engine process")

    def run(self) -> None:
        """Step while there is work, reporting after every step (one message a step: every request's new tokens
        and the counters); block on the pipe while there is none."""
        try:
            while not self._stop:
                report = StepReport(self.rank)
                busy = self.engine.has_unfinished_requests()
                touched = self._take_messages(0.0 if busy else IDLE_WAIT_SECONDS, report)
                if self._stop:
                    break
                stepped = self.engine.has_unfinished_requests()
                if stepped:
                    report.deltas = [self._delta(output) for output in self.engine.step()]
                if touched or stepped or self.offload_traffic_moved():
                    report.load = self._load()
                    self.conn.send(report)
        finally:
            self.close()
