"""The engine process of one rank: its scheduler, caches and model runner, its share of the routed experts.

Every iteration, every rank takes the messages that arrived, then all ranks exchange two numbers over the
control group (does anyone have work, does anyone stop) and act on the sum together: when someone has work
every rank steps (a rank whose step runs no forward joins the others' collectives instead: a decode bucket of
padding rows or one dummy token, :mod:`dsinfer.parallel.graph_steps` agrees which), so the EP collectives
never wait; when nobody has work every
rank sleeps briefly on its messages (a new request wakes them all); a stop ends every rank after the same
iteration. The rank reports what changed after each step (:class:`dsinfer.parallel.messages.StepReport`).

A rank whose parent process disappears exits at once: it can be blocked in a collective with a dead peer,
where no message would reach it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import Client, Connection

import torch
import torch.distributed as dist

from dsinfer.config import ModelConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.engine.outputs import RequestOutput
from dsinfer.parallel.ep import ExpertParallel, ExpertPlacement, backbone_expert_filter
from dsinfer.parallel.graph_steps import GraphStepAgreement
from dsinfer.parallel.groups import destroy_rank_groups, device_for_rank, init_rank_groups
from dsinfer.parallel.messages import (
    AbortRequest,
    AddRequest,
    CompletionDelta,
    FinishSequence,
    RankFailed,
    RankLoad,
    RankReady,
    RankSpec,
    RequestDelta,
    Shutdown,
    StepReport,
)

log = logging.getLogger("dsinfer.rank")

IDLE_POLL_SECONDS = 0.02  # how long an idle rank waits for a message before the next control exchange
RANK_AUTHKEY_ENV = "DSINFER_RANK_AUTHKEY"  # the shared secret of the ranks of several hosts


def placement_for(spec: RankSpec, config: ModelConfig) -> ExpertPlacement:
    ep = spec.parallel.expert_parallel_size
    if spec.parallel.expert_placement:
        return ExpertPlacement.from_file(spec.parallel.expert_placement, config.n_routed_experts, ep)
    return ExpertPlacement.contiguous(config.n_routed_experts, ep)


def rank_main(spec: RankSpec, conn: Connection | None = None) -> None:
    """Entry point of a rank process (``conn``: its pipe to the API process; None: connect over TCP)."""
    logging.basicConfig(
        level=spec.log_level.upper(), format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: %(message)s"
    )
    # Ctrl-C in a terminal reaches every process of the group: the API process drains, then stops the ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())  # not the default multiprocessing lock: a rank that dies leaks none
    if conn is None:
        conn = _connect_to_api(spec)
    try:
        _RankLoop(spec, conn).run()
    except BaseException as exc:
        log.error("rank %d failed:\n%s", spec.rank, traceback.format_exc())
        try:
            conn.send(RankFailed(spec.rank, f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        os._exit(1)  # peers may be blocked in a collective with us: no orderly teardown is possible


def _connect_to_api(spec: RankSpec, timeout: float = 600.0) -> Connection:
    """A rank of another host reaches the API process on host 0 (which may not be listening yet)."""
    address = (spec.parallel.master_addr, spec.master_port + 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(address, authkey=os.environ.get(RANK_AUTHKEY_ENV, "").encode())
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.25)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="dsinfer-parent-watch", daemon=True).start()


class _RankLoop:
    def __init__(self, spec: RankSpec, conn: Connection) -> None:
        from dsinfer.models.deepseek_v41 import DeepseekV41
        from dsinfer.models.loader import load_model
        from dsinfer.tokenizer import Tokenizer

        self.spec, self.conn, self.rank = spec, conn, spec.rank
        device = device_for_rank(spec.engine.device, spec.parallel, spec.rank)
        self.groups = init_rank_groups(spec.parallel, spec.rank, spec.master_port, device)
        torch.set_num_threads(max(1, torch.get_num_threads() // spec.parallel.ranks_per_node))
        config = ModelConfig.from_file(spec.model_dir)
        placement = placement_for(spec, config)
        self.model = load_model(
            spec.model_dir,
            dtype=torch.bfloat16 if spec.engine.dtype == "bfloat16" else torch.float32,
            device=device,
            progress=False,
            engram_placement=spec.engine.engram_placement,
            owned_experts=backbone_expert_filter(placement, spec.rank),
        )
        self._closable = isinstance(self.model, DeepseekV41)
        groups = self.groups
        self.dispatcher = ExpertParallel(placement, spec.rank, groups.expert_group, device, groups.graph_expert_group)
        self.dispatcher.attach(self.model)
        # One thread steps (collectives from two threads would interleave). V4 decode replays CUDA graphs
        # (the fixed-capacity dispatch inside, captured here by every rank in the same order); V4.1 runs
        # eagerly, since its sharded Engram exchange reads sizes on the host.
        eager = spec.engine.enforce_eager or self._closable
        engine_config = replace(spec.engine, device=str(device), async_scheduling=False, enforce_eager=eager)
        with self.dispatcher.fixed_capacity():  # the only forwards while building are the graph captures
            self.engine = LLMEngine(self.model, Tokenizer.from_dir(spec.model_dir), engine_config)
        self.steps = GraphStepAgreement(
            self.engine.runner, self.dispatcher, self.groups.control_group, self.groups.world_size
        )
        self.device = device
        self._sent: dict[tuple[str, int], int] = {}  # tokens already reported per completion
        self._sequences: dict[str, list] = {}  # a request's sequences (the engine forgets finished ones)
        self._stop = False
        if spec.rank == 0:
            log.warning("expert placement: %s", placement.describe())
        self.conn.send(
            RankReady(
                spec.rank,
                os.getpid(),
                self.engine.max_model_len,
                self.engine.blocks.num_blocks,
                self.engine.runner.block_tokens,
                placement.describe(),
            )  # fmt: skip
        )

    def run(self) -> None:
        idle = True
        try:
            while True:
                report = StepReport(self.rank)
                touched = self._take_messages(IDLE_POLL_SECONDS if idle else 0.0, report)
                local_work = self.engine.has_unfinished_requests()
                flags = torch.tensor([int(local_work), int(self._stop)], dtype=torch.int64)
                dist.all_reduce(flags, group=self.groups.control_group)
                if flags[1].item():
                    break
                idle = flags[0].item() == 0
                if not idle:
                    self.steps.ran_forward = False
                    outputs = self.engine.step() if local_work else []
                    if not self.steps.ran_forward:
                        self.steps.idle(self.device)
                    report.deltas = [self._delta(out) for out in outputs]
                if touched or not idle:
                    report.load = self._load()
                    self.conn.send(report)
        finally:
            self.engine.close()
            if self._closable:
                self.model.close()
            destroy_rank_groups()

    def _take_messages(self, timeout: float, report: StepReport) -> bool:
        """Apply what the API process sent; True when anything arrived."""
        arrived = False
        try:
            if not self.conn.poll(timeout):
                return False
            while self.conn.poll():
                arrived = True
                self._apply(self.conn.recv(), report)
        except (EOFError, OSError):  # the API process is gone: stop with everyone else
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

    def _load(self) -> RankLoad:
        engine = self.engine
        return RankLoad(
            len(engine.scheduler.waiting), len(engine.scheduler.running), engine.blocks.num_used,
            engine.blocks.num_blocks, engine.blocks.prefix_queries, engine.blocks.prefix_hits,
            engine.scheduler.num_preemptions, self.steps.graph_steps, self.steps.padded_graph_steps,
        )  # fmt: skip
