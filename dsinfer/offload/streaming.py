"""Routed experts read from the checkpoint straight to where the offload keeps them, each expert once.

A model loaded with ``expert_device="meta"`` (:mod:`dsinfer.models.deferred_experts`) has every other weight on
its device and only a record of where each routed expert is stored. Here each layer's resident set is chosen
first (the ``--expert-stats`` counts, or an even split), then exactly the rows they need are allocated: the
arena's slots on the device and, per layer, a pinned host store of only the offloaded experts. Then each expert
is read once: a resident one into its slot (through the one-expert tensors the shard read gives, on the host),
an offloaded one into its host row. At no point do more routed-expert bytes live in host memory than the
offloaded experts plus one expert, so V4-Flash (147 GB of experts) loads beside 128 GiB of RAM when the GPU
keeps the rest. A store of only the offloaded experts re-balances by swapping through the layer's fetch buffer
(:meth:`~dsinfer.offload.residency.LayerResidency.place`).
"""

from __future__ import annotations

import torch

from dsinfer.offload.arena import ExpertArena, empty_like_rows
from dsinfer.offload.host_store import HostStore
from dsinfer.offload.residency import LayerResidency
from dsinfer.offload.stats import ExpertStats
from dsinfer.ops.moe import ExpertWeights


def host_rows(like: ExpertWeights, rows: int, device: torch.device) -> ExpertWeights:
    """A host store's rows: ``rows`` experts in host memory, pinned when the GPU reads them (CUDA)."""
    return empty_like_rows(like, rows, "cpu", mapped_for=device if device.type == "cuda" else None)


def stream_resident(model: torch.nn.Module, moes: list, device: torch.device) -> None:
    """Every expert stays on the device: read each layer's experts into one stack there and serve it."""
    source = model.deferred_experts
    for layer_id, moe in moes:
        path = deferred_path(layer_id)
        like = source.like(path)
        stacked = empty_like_rows(like, like.num_experts, device)
        for index in range(stacked.num_experts):
            source.read_into(path, index, stacked, index)
        moe.pack(stacked, stacked.num_experts)
    _release(model)


def stream_offloaded(model: torch.nn.Module, moes: list, arena: ExpertArena, stats: ExpertStats, routers: list):
    """Choose every layer's resident set, allocate its arena slots and host rows, then read each expert once
    into one of them; the layers' residencies (their first placement filled)."""
    source, device, experts = model.deferred_experts, arena.device, arena.resident + arena.fetch_slots
    resident_sets = [stats.resident(row, arena.resident) for row in range(len(moes))]  # before any read
    offloaded_sets = [[e for e in range(experts) if e not in set(wanted)] for wanted in resident_sets]
    stores = [host_rows(arena.weights, len(offloaded), device) for offloaded in offloaded_sets]
    for row, (layer_id, _) in enumerate(moes):
        path = deferred_path(layer_id)
        slot = {expert: arena.resident_rows(row).start + i for i, expert in enumerate(resident_sets[row])}
        host_row = {expert: i for i, expert in enumerate(offloaded_sets[row])}
        for expert in range(experts):
            if expert in slot:
                source.read_into(path, expert, arena.weights, slot[expert])
            else:
                source.read_into(path, expert, stores[row], host_row[expert])
    _release(model)
    layers = []
    for row, ((_, moe), router) in enumerate(zip(moes, routers, strict=True)):
        host = HostStore(stores[row], offloaded_sets[row], experts, device)
        layers.append(LayerResidency(row, host, arena, stats, moe.ops, router))
        layers[-1].place(resident_sets[row], filled=True)
    return layers


def deferred_path(layer_id: int) -> str:
    """The deferred record's name of backbone layer ``layer_id``'s MoE (its module path)."""
    return f"layers.{layer_id}.ffn"


def _release(model: torch.nn.Module) -> None:
    """Every deferred expert is read: close the shards and drop the record."""
    model.deferred_experts.close()
    del model.deferred_experts
