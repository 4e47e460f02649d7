"""torch.distributed for one rank: the world (the EP group, NCCL on GPUs and gloo on CPUs) and a gloo group
for the per-step control exchange, which stays on the host whatever the device."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dsinfer.parallel.config import ParallelConfig

# A rank that dies is noticed by the API process within a second, which then ends every rank; this only
# bounds how long a collective can wait when something else goes wrong.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass
class RankGroups:
    rank: int
    world_size: int
    device: torch.device
    expert_group: object  # the world: every rank holds a share of every backbone MoE layer
    control_group: object  # gloo: the per-step "who has work, who stops" exchange
    graph_expert_group: object  # the world again, for the collectives captured in decode graphs


def device_for_rank(device: str, parallel: ParallelConfig, rank: int) -> torch.device:
    """Rank r uses GPU (r mod ranks per host) of its host; on the CPU every rank uses the CPU."""
    if device.startswith("cuda") and parallel.is_multi_rank:
        return torch.device("cuda", rank % parallel.ranks_per_node)
    return torch.device(device)


def init_rank_groups(parallel: ParallelConfig, rank: int, master_port: int, device: torch.device) -> RankGroups:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{parallel.master_addr}:{master_port}",
        rank=rank,
        world_size=parallel.world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    # Collectives replayed from CUDA graphs get a communicator of their own, apart from the eager steps' (what
    # vLLM and SGLang do too): a captured NCCL call and an eager one never share a communicator's state.
    graphs = dist.new_group(backend="nccl") if backend == "nccl" else dist.group.WORLD
    return RankGroups(rank, parallel.world_size, device, dist.group.WORLD, control, graphs)


def destroy_rank_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
