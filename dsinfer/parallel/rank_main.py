"""The entry point of an engine process, and the loop of one rank of several (its share of the routed experts).

:func:`rank_main` runs the loop the layout needs: with one rank
:class:`~dsinfer.parallel.engine_loop.EngineProcessLoop` (no peers: the engine as configured), else
:class:`_RankLoop`. Among several ranks, every iteration every rank takes the messages that arrived, then all
ranks exchange two numbers over the control group (does anyone have work, does anyone stop) and act on the sum
together: when someone has work every rank steps (a rank whose step runs no forward joins the others'
collectives instead: a decode bucket of padding rows or one dummy token, :mod:`dsinfer.parallel.graph_steps`
agrees which), so the EP collectives never wait; when nobody has work every rank sleeps briefly on its messages
(a new request wakes them all); a stop ends every rank after the same iteration. The rank reports what changed
after each step (:class:`dsinfer.parallel.messages.StepReport`).

An engine process whose parent process disappears exits at once: a rank can be blocked in a collective with a
dead peer, where no message would reach it.
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

from dsinfer import envs
from dsinfer.config import ModelConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.offload.install import offload_experts
from dsinfer.parallel.engine_loop import EngineLoop, EngineProcessLoop
from dsinfer.parallel.ep import ExpertParallel, ExpertPlacement, backbone_expert_filter
from dsinfer.parallel.graph_steps import GraphStepAgreement
from dsinfer.parallel.groups import destroy_rank_groups, device_for_rank, init_rank_groups
from dsinfer.parallel.messages import RankFailed, RankLoad, RankSpec, StepReport

log = logging.getLogger("dsinfer.rank")

IDLE_POLL_SECONDS = 0.02  # how long an idle rank waits for a message before the next control exchange
RANK_AUTHKEY_ENV = envs.RANK_AUTHKEY.name  # the shared secret of the ranks of several hosts


def placement_for(spec: RankSpec, config: ModelConfig) -> ExpertPlacement:
    ep = spec.parallel.expert_parallel_size
    if spec.parallel.expert_placement:
        return ExpertPlacement.from_file(spec.parallel.expert_placement, config.n_routed_experts, ep)
    return ExpertPlacement.contiguous(config.n_routed_experts, ep)


def rank_main(spec: RankSpec, conn: Connection | None = None) -> None:
    """Entry point of an engine process (``conn``: its pipe to the API process; None: connect over TCP)."""
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
        loop = _RankLoop if spec.parallel.is_multi_rank else EngineProcessLoop
        loop(spec, conn).run()
    except BaseException as exc:
        log.error("rank %d failed:\n%s", spec.rank, traceback.format_exc())
        _report_failure(conn, spec.rank, exc)
        os._exit(1)  # peers may be blocked in a collective with us: no orderly teardown is possible


def _report_failure(conn: Connection, rank: int, exc: BaseException) -> None:
    """Tell the API process why, with the exception itself when it pickles (else its text alone)."""
    message = f"{type(exc).__name__}: {exc}"
    for error in (exc, None):
        try:
            conn.send(RankFailed(rank, message, error))
            return
        except OSError:
            return  # the API process is gone
        except Exception:  # the exception does not pickle: send its text alone
            continue


def _connect_to_api(spec: RankSpec, timeout: float = 600.0) -> Connection:
    """A rank of another host reaches the API process on host 0 (which may not be listening yet)."""
    address = (spec.parallel.master_addr, spec.master_port + 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(address, authkey=(envs.RANK_AUTHKEY.get() or "").encode())
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


class _RankLoop(EngineLoop):
    """One rank of several: its share of the experts, and the per-step agreement with its peers."""

    def __init__(self, spec: RankSpec, conn: Connection) -> None:
        from dsinfer.models.loader import load_model
        from dsinfer.tokenizer import Tokenizer

        device = device_for_rank(spec.engine.device, spec.parallel, spec.rank)
        self.groups = init_rank_groups(spec.parallel, spec.rank, spec.master_port, device)
        torch.set_num_threads(max(1, torch.get_num_threads() // spec.parallel.ranks_per_node))
        config = ModelConfig.from_file(spec.model_dir)
        placement = placement_for(spec, config)
        model = load_model(
            spec.model_dir,
            dtype=torch.bfloat16 if spec.engine.dtype == "bfloat16" else torch.float32,
            device=device,
            progress=False,
            engram_placement=spec.engine.engram_placement,
            owned_experts=backbone_expert_filter(placement, spec.rank),
            expert_device=None if spec.engine.expert_offload is None else "meta",  # offloaded: read where placed
        )
        groups = self.groups
        self.dispatcher = ExpertParallel(placement, spec.rank, groups.expert_group, device, groups.graph_expert_group)
        self.dispatcher.attach(model)
        model = offload_experts(model, replace(spec.engine, device=str(device)))  # each rank offloads its own
        # One thread steps (collectives from two threads would interleave). V4 decode replays CUDA graphs
        # (the fixed-capacity dispatch inside, captured here by every rank in the same order); V4.1 runs
        # eagerly, since its sharded Engram exchange reads sizes on the host (the model says: ranks_replay_graphs).
        # Speculative steps run eagerly too: their verify and draft graphs would need the ranks to agree on
        # buckets as plain decode graphs do (dsinfer.parallel.graph_steps), which they do not yet.
        speculative = spec.engine.speculative_config is not None
        eager = spec.engine.enforce_eager or not model.ranks_replay_graphs or speculative
        engine_config = replace(
            spec.engine, device=str(device), async_scheduling=False, enforce_eager=eager, kernel_warmup=False
        )  # the ranks' forwards must pair up: no local warm-up
        with self.dispatcher.fixed_capacity():  # the only forwards while building are the graph captures
            engine = LLMEngine(model, Tokenizer.from_dir(spec.model_dir), engine_config)
        super().__init__(spec, conn, model, engine)
        self.steps = GraphStepAgreement(
            self.engine.runner, self.dispatcher, self.groups.control_group, self.groups.world_size,
            self.engine.worker.speculative,
        )  # fmt: skip
        self.device = device
        if spec.rank == 0:
            log.warning("expert placement: %s", placement.describe())
        self.send_ready(placement.describe())

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
                    self.steps.begin_step()
                    outputs = self.engine.step() if local_work else []
                    if not self.steps.ran_forward:
                        self.steps.idle(self.device)
                    report.deltas = [self._delta(out) for out in outputs]
                if touched or not idle or self.offload_traffic_moved():
                    report.load = self._load()
                    self.conn.send(report)
        finally:
            self.close()
            destroy_rank_groups()

    def _load(self) -> RankLoad:
        return super()._load(graph_steps=self.steps.graph_steps, padded_graph_steps=self.steps.padded_graph_steps)
