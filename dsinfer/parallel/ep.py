"""Expert parallelism: each EP rank holds some routed experts of every backbone MoE layer; tokens travel to them.

Placement. By default rank ``r`` of ``n`` holds the contiguous experts ``[r E/n, (r+1) E/n)``. A placement
file (EPLB-style redundant experts) lists each rank's experts instead, ``{"ranks": [[0, 1, 2, 7], [3, 4, 5, 6,
7]]}``: every expert at least once, an expert held by several ranks is a replica, and a token's slot goes to
replica ``(token + source rank) mod replicas``. One placement serves every backbone layer; it is logged.

Dispatch and combine (:class:`ExpertParallel`, called by :meth:`dsinfer.layers.moe.MoE._dispatch`). Every
(token, choice) slot is mapped to its physical expert on the device, the slots are ordered by physical expert
(so by destination rank), the per-rank counts are exchanged with one ``all_to_all_single`` of device tensors,
read once on the host (the sizes of the variable all-to-all), then the token rows and their (local expert,
mixing weight) pairs go out, each rank runs ``routed_moe`` on what it received (one expert per row, the
weight applied there exactly as the single-rank op applies it), the rows come back and are summed per token.
With the default placement a token's slots are summed in increasing expert order, as the single-rank
reference sums them, so fp32 results differ from one rank's by matmul rounding at most.

Decode steps replayed from CUDA graphs cannot read sizes on the host: inside
:meth:`ExpertParallel.fixed_capacity` the dispatcher runs :func:`dsinfer.parallel.ep_fixed.dispatch_fixed`
instead, whose buffers have a static capacity (every rank must then run the same number of tokens). The
variable-size path stays for prefill and mixed steps, where a static capacity of ``T k`` rows per destination
would cost ``ranks`` times the activation memory of a long prefill chunk.

Every rank must make the same collective calls in the same order: an engine step runs one forward, and a
rank with nothing scheduled runs :func:`run_idle_pass` (one dummy token through the model), or, when the
others replay a decode graph, the same graph with every row padding (:mod:`dsinfer.parallel.graph_steps`).
MTP and DSpark MoE layers stay whole on every rank (they run without collectives).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dsinfer.config.model import ConfigError
from dsinfer.layers.moe import MoE
from dsinfer.parallel.ep_fixed import dispatch_fixed, routed_rows

log = logging.getLogger("dsinfer.parallel")

BACKBONE_MOE = re.compile(r"^layers\.\d+\.ffn$")
"""The MoE modules whose routed experts are sharded (the backbone's, not MTP's or DSpark's)."""


@dataclass(frozen=True)
class ExpertPlacement:
    """Which global experts each EP rank holds, in the order the rank stacks them."""

    num_experts: int
    rank_experts: tuple[tuple[int, ...], ...]

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int) -> ExpertPlacement:
        if num_experts % ep_size:
            raise ConfigError(
                f"--expert-parallel-size {ep_size} must divide the model's n_routed_experts ({num_experts})"
            )
        per_rank = num_experts // ep_size
        return cls(num_experts, tuple(tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(ep_size)))

    @classmethod
    def from_file(cls, path: str | Path, num_experts: int, ep_size: int) -> ExpertPlacement:
        """Read a placement file; one clear message for anything that does not describe ``ep_size`` ranks."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"expert placement file {str(path)!r}: {exc}") from None
        ranks = data.get("ranks") if isinstance(data, dict) else None
        if not isinstance(ranks, list) or not all(isinstance(r, list) for r in ranks):
            raise ConfigError(f'expert placement file {str(path)!r}: expected {{"ranks": [[expert ids], ...]}}')
        placement = cls(num_experts, tuple(tuple(r) for r in ranks))
        placement.validate(ep_size, source=f"expert placement file {str(path)!r}")
        return placement

    def validate(self, ep_size: int, source: str = "expert placement") -> None:
        if len(self.rank_experts) != ep_size:
            raise ConfigError(f"{source}: lists {len(self.rank_experts)} ranks for --expert-parallel-size {ep_size}")
        seen: set[int] = set()
        for rank, experts in enumerate(self.rank_experts):
            bad = [e for e in experts if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < self.num_experts]
            if bad or not experts:
                raise ConfigError(
                    f"{source}: rank {rank} needs expert ids in [0, {self.num_experts}), got {bad or '[]'}"
                )
            if len(set(experts)) != len(experts):
                raise ConfigError(f"{source}: rank {rank} lists an expert twice")
            seen.update(experts)
        missing = sorted(set(range(self.num_experts)) - seen)
        if missing:
            raise ConfigError(f"{source}: experts {missing[:8]} are held by no rank")

    @property
    def num_physical(self) -> int:
        return sum(len(r) for r in self.rank_experts)

    @property
    def is_redundant(self) -> bool:
        return self.num_physical > self.num_experts

    def describe(self) -> str:
        counts = [len(r) for r in self.rank_experts]
        extra = self.num_physical - self.num_experts
        return f"{self.num_experts} experts + {extra} redundant over {len(counts)} ranks, per rank {counts}"


class ExpertParallel:
    """Dispatch and combine for the sharded MoE layers of one rank (see the module docstring).

    ``group`` None runs the same path in a single process with the collectives left out (what EP = 1 costs
    without torch.distributed); a process group of any size, including one rank, runs them for real.
    ``static_group``: the group of the fixed-capacity dispatch (default ``group``), whose collectives decode
    graphs capture.
    """

    def __init__(
        self, placement: ExpertPlacement, rank: int, group, device: torch.device | str, static_group=None
    ) -> None:
        self.placement, self.rank, self.group = placement, rank, group
        self.static_group = group if static_group is None else static_group
        self.ep_size = len(placement.rank_experts)
        self.layers: list[MoE] = []
        self.calls = 0  # MoE layers run since the last reset (an idle step runs them empty)
        self.static_capacity = False  # inside fixed_capacity(): the graph-safe dispatch (ep_fixed)
        self.most_local_experts = max(len(r) for r in placement.rank_experts)
        phys_rank, phys_local, replicas = [], [], [[] for _ in range(placement.num_experts)]
        for rank_id, experts in enumerate(placement.rank_experts):
            for local, expert in enumerate(experts):
                replicas[expert].append(len(phys_rank))
                phys_rank.append(rank_id)
                phys_local.append(local)
        widest = max(len(r) for r in replicas)
        table = [r + [r[0]] * (widest - len(r)) for r in replicas]
        self.phys_rank = torch.tensor(phys_rank, dtype=torch.int64, device=device)
        self.phys_local = torch.tensor(phys_local, dtype=torch.float32, device=device)
        self.phys_local_ids = self.phys_local.long()
        self.replicas = torch.tensor(table, dtype=torch.int64, device=device)
        self.num_replicas = torch.tensor([len(r) for r in replicas], dtype=torch.int64, device=device)
        self.rank_ids = torch.arange(self.ep_size, dtype=torch.int64, device=device)

    @contextmanager
    def fixed_capacity(self) -> Iterator[None]:
        """Dispatch with static shapes (no host read: capturable) while inside; every rank runs as many tokens."""
        previous, self.static_capacity = self.static_capacity, True
        try:
            yield
        finally:
            self.static_capacity = previous

    def attach(self, model: torch.nn.Module) -> list[MoE]:
        """Route every backbone MoE layer of ``model`` through this dispatcher (their experts are already sharded)."""
        self.layers = [m for name, m in model.named_modules() if BACKBONE_MOE.match(name) and isinstance(m, MoE)]
        for moe in self.layers:
            moe.expert_parallel = self
        return self.layers

    def __call__(self, moe: MoE, x: torch.Tensor, expert_ids: torch.Tensor, expert_weights: torch.Tensor):
        """The routed part of ``moe`` for this rank's tokens ``x [T, H]``: ``[T, H]`` in ``x.dtype``."""
        self.calls += 1
        top_k = expert_ids.shape[1]
        flat = expert_ids.reshape(-1)
        if self.static_capacity:
            return dispatch_fixed(self, moe, x, self._physical(flat, top_k), expert_weights)
        token = torch.arange(flat.numel(), device=x.device) // top_k
        physical = self._physical(flat, top_k, token)
        order = torch.argsort(physical, stable=True)
        physical = physical.index_select(0, order)
        token = token.index_select(0, order)
        send_counts = torch.zeros(self.ep_size, dtype=torch.int64, device=x.device)
        send_counts.scatter_add_(0, self.phys_rank.index_select(0, physical), torch.ones_like(physical))
        meta = torch.stack([self.phys_local.index_select(0, physical), expert_weights.reshape(-1)[order]], dim=1)
        rows = x.index_select(0, token)
        if self.ep_size == 1:  # one rank: the sizes are known without reading the device
            send = recv = [flat.numel()]
        else:
            recv_counts = self._exchange(send_counts)
            send, recv = send_counts.tolist(), recv_counts.tolist()  # the one host read: the all-to-all sizes
        recv_rows = self._all_to_all(rows, recv, send)
        recv_meta = self._all_to_all(meta, recv, send)
        if recv_rows.shape[0]:
            local_ids = recv_meta[:, :1].long()
            out = routed_rows(moe, recv_rows, local_ids, recv_meta[:, 1:].contiguous())
        else:
            out = recv_rows
        back = self._all_to_all(out, send, recv)
        return torch.zeros_like(x).index_add_(0, token, back)

    def _physical(self, flat: torch.Tensor, top_k: int, token: torch.Tensor | None = None) -> torch.Tensor:
        """The physical expert of every slot (``flat``: the slots' expert ids, token-major)."""
        if not self.placement.is_redundant:
            return flat  # contiguous shards: the physical id is the expert id
        if token is None:
            token = torch.arange(flat.numel(), device=flat.device) // top_k
        replica = (token + self.rank) % self.num_replicas.index_select(0, flat)
        return self.replicas[flat, replica]

    def _exchange(self, send_counts: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return send_counts.clone()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        return recv_counts

    def _all_to_all(self, tensor: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        if self.group is None:
            return tensor
        out = tensor.new_empty((sum(out_splits), *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), out_splits, in_splits, group=self.group)
        return out


def run_idle_pass(model: torch.nn.Module, device: torch.device | str) -> None:
    """A rank with nothing to run still joins every collective of a forward: it runs one dummy token through
    the whole model on a scratch cache (the engine's caches are untouched). A forward, not just the MoE
    layers, because sharded Engram tables (``engram_placement='sharded'``) exchange rows over the same
    group in between, and the order of the collectives must match the busy ranks'."""
    from dsinfer.kv.batch import PackedBatch

    with torch.inference_mode():
        model(
            PackedBatch.from_sequences([[0]], device=device),
            logits_for=torch.zeros(1, dtype=torch.int64, device=device),
        )


def backbone_expert_filter(placement: ExpertPlacement, rank: int):
    """For the loader: (MoE module path, global expert) -> keep it on this rank; also the stacking order."""
    owned = placement.rank_experts[rank]

    def owned_experts(moe_path: str) -> tuple[int, ...] | None:
        return owned if BACKBONE_MOE.match(moe_path) else None

    return owned_experts
