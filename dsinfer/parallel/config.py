"""The multi-rank layout (DP attention x CP = EP MoE) and the checks it must pass before any weights load."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from dsinfer.config.model import ConfigError


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks, on how many hosts, and where they meet.

    ``data_parallel_size`` ranks each own their requests, caches and scheduler (``max_num_seqs`` counts per
    DP rank); ``expert_parallel_size`` ranks share the routed experts of every MoE layer. The layout requires
    ``data_parallel_size x context_parallel_size == expert_parallel_size`` (one world of EP ranks). Several
    hosts (``nnodes``) each start ``world_size / nnodes`` ranks; the ranks meet at ``master_addr:master_port``
    (torch.distributed's TCP rendezvous) and host 0 runs the API process, which the ranks of every host reach
    at ``master_addr:master_port + 1``.
    """

    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (one host only)
    expert_placement: str | None = None  # a JSON placement file (redundant experts); None: contiguous shards

    def __post_init__(self) -> None:
        flags = (
            ("--data-parallel-size", self.data_parallel_size),
            ("--expert-parallel-size", self.expert_parallel_size),
            ("--context-parallel-size", self.context_parallel_size),
            ("--nnodes", self.nnodes),
        )
        for name, value in flags:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer of at least 1, got {value!r}")
        dp, ep, cp = self.data_parallel_size, self.expert_parallel_size, self.context_parallel_size
        if dp * cp != ep:
            raise ConfigError(
                "--data-parallel-size x --context-parallel-size must equal --expert-parallel-size; "
                f"got {dp} x {cp} != {ep}"
            )
        if cp != 1:
            raise ConfigError(f"--context-parallel-size {cp}: context parallelism is not available yet; use 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must lie in [0, --nnodes={self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise ConfigError(
                f"--nnodes {self.nnodes} must divide the world size (--expert-parallel-size {self.world_size})"
            )
        if self.nnodes > 1 and self.master_port is None:
            raise ConfigError("--master-port is required with --nnodes > 1 (every host must name the same one)")
        if self.master_port is not None and not 0 < self.master_port < 65535:
            raise ConfigError(f"--master-port must lie in [1, 65534], got {self.master_port}")

    @property
    def world_size(self) -> int:
        return self.expert_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this host starts."""
        first = self.node_rank * self.ranks_per_node
        return range(first, first + self.ranks_per_node)

    @property
    def is_multi_rank(self) -> bool:
        return self.world_size > 1

    def check_model(self, n_routed_experts: int) -> None:
        """Experts must split evenly over the EP ranks (a placement file may add redundant ones on top)."""
        if n_routed_experts % self.expert_parallel_size:
            raise ConfigError(
                f"--expert-parallel-size {self.expert_parallel_size} must divide the model's "
                f"n_routed_experts ({n_routed_experts})"
            )

    def check_devices(self, device: str, available_gpus: int) -> None:
        """On CUDA every rank of this host needs a GPU of its own."""
        if device.startswith("cuda") and self.is_multi_rank and self.ranks_per_node > available_gpus:
            raise ConfigError(
                f"{self.ranks_per_node} ranks per host (--expert-parallel-size {self.world_size} over "
                f"--nnodes {self.nnodes}) need as many GPUs, but this host has {available_gpus}"
            )
        if device.startswith("cuda:") and self.is_multi_rank:
            raise ConfigError(f"--device {device}: with several ranks give 'cuda' (rank r uses GPU r of its host)")

    def resolved_master_port(self) -> int:
        """The rendezvous port: as given, else a free one on this host."""
        if self.master_port is not None:
            return self.master_port
        return free_port()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
