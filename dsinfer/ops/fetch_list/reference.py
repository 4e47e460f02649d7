"""The truth for ``offload_fetch_list``: the offload's fetch list and bookkeeping as torch ops."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.registry import REFERENCE, register

__all__ = ["FetchListInputs", "offload_fetch_list_reference"]


@dataclass(frozen=True)
class FetchListInputs:
    """One layer's step (see the package docstring). Every tensor is on the layer's device; ``prefetched``,
    ``counters`` and ``counts`` are updated in place, ``marks`` is scratch the Triton backend owns."""

    expert_ids: torch.Tensor  # [T, k] int64: the router's choices (stage) or prediction (ahead)
    resident: torch.Tensor  # [E] bool: experts on the device
    prefetched: torch.Tensor  # [E] bool: experts fetched ahead for this step
    offloaded_ids: torch.Tensor  # [F] int64: the offloaded experts, in fetch-row order
    row_of_expert: torch.Tensor  # [E] int64: each expert's host-store row
    counters: torch.Tensor  # [4] int64: reads, reads served by resident experts, fetched, fetched ahead
    counts: torch.Tensor | None  # [E] int64: the layer's routing counts (stage), None (ahead)
    marks: torch.Tensor  # [E] int32 scratch
    ahead: bool


def check_inputs(inputs: FetchListInputs) -> None:
    """Shapes and dtypes every backend relies on (host-side metadata only)."""
    experts = inputs.resident.shape[0]
    expected = {"resident": (inputs.resident, torch.bool, (experts,)),
                "prefetched": (inputs.prefetched, torch.bool, (experts,)),
                "row_of_expert": (inputs.row_of_expert, torch.int64, (experts,)),
                "counters": (inputs.counters, torch.int64, (4,)),
                "marks": (inputs.marks, torch.int32, (experts,))}  # fmt: skip
    if inputs.counts is not None:
        expected["counts"] = (inputs.counts, torch.int64, (experts,))
    for name, (tensor, dtype, shape) in expected.items():
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"offload_fetch_list: {name} must be {dtype} {shape}, got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")  # fmt: skip
    for name in ("expert_ids", "offloaded_ids"):
        if getattr(inputs, name).dtype != torch.int64:
            raise ValueError(f"offload_fetch_list: {name} must be int64, got {getattr(inputs, name).dtype}")
    if inputs.ahead == (inputs.counts is not None):
        raise ValueError("offload_fetch_list: counts are kept by the stage, not by a fetch ahead")


@register("offload_fetch_list", REFERENCE)
def offload_fetch_list_reference(inputs: FetchListInputs) -> torch.Tensor:
    """The store rows ``[F]`` to copy (-1: nothing), with the bookkeeping of the package docstring done."""
    check_inputs(inputs)
    flat = inputs.expert_ids.reshape(-1)
    experts = inputs.resident.shape[0]
    if inputs.counts is not None:
        inputs.counts.index_add_(0, flat, torch.ones_like(flat))
    chosen = torch.zeros(experts, dtype=torch.int32, device=flat.device).scatter_(0, flat, 1).bool()
    if inputs.ahead:
        need = chosen & ~inputs.resident
        inputs.prefetched.copy_(need)
        inputs.counters[2:].add_(need.sum())
    else:
        need = chosen & ~inputs.resident & ~inputs.prefetched
        inputs.prefetched.zero_()
        inputs.counters[:3].add_(torch.stack([chosen.sum(), (chosen & inputs.resident).sum(), need.sum()]))
    wanted = need.index_select(0, inputs.offloaded_ids)
    rows = inputs.row_of_expert.index_select(0, inputs.offloaded_ids)
    return torch.where(wanted, rows, torch.full_like(rows, -1))
