"""The plan of one layer's fetch: its row ids sorted and de-duplicated on the device, with the inverse map.

Sorting orders the reads by address, which is what makes host reads fast (neighbouring rows share
pages, so the GPU's and the IOMMU's translation caches hit); n-gram hashes of real text repeat a
lot, so de-duplication saves rows too. Building the plan never waits for the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FetchPlan", "plan_fetch"]


@dataclass
class FetchPlan:
    """What to gather for one layer's ids.

    ``ids[:count]`` are the rows to read (sorted and unique when de-duplicating); ``count`` is a
    one-element int64 tensor on the ids' device, so building the plan never waits for the GPU.
    ``inverse`` maps each requested id (flattened) to its row among the gathered ones; ``None``
    means the gathered rows are already in request order.
    """

    ids: torch.Tensor
    count: torch.Tensor
    inverse: torch.Tensor | None


def plan_fetch(flat_ids: torch.Tensor, *, dedup: bool = True, sort: bool = True) -> FetchPlan:
    """Sort and de-duplicate one layer's row ids without a host synchronisation.

    ``torch.unique`` must learn the number of unique ids on the host to size its output; here the
    output keeps the input's length, the unique ids fill its front and ``count`` says how many.
    ``dedup`` implies sorting. With neither, the ids are gathered as given.
    """
    if flat_ids.dim() != 1:
        raise ValueError(f"plan_fetch takes a 1-D tensor of row ids, got shape {tuple(flat_ids.shape)}")
    n = flat_ids.numel()
    if not (dedup or sort) or n == 0:
        return FetchPlan(flat_ids, torch.full((1,), n, dtype=torch.int64, device=flat_ids.device), None)
    sorted_ids, order = torch.sort(flat_ids)
    inverse = torch.empty_like(order)
    if not dedup:
        inverse[order] = torch.arange(n, device=flat_ids.device)
        return FetchPlan(sorted_ids, torch.full((1,), n, dtype=torch.int64, device=flat_ids.device), inverse)
    is_first = torch.ones(n, dtype=torch.bool, device=flat_ids.device)
    torch.ne(sorted_ids[1:], sorted_ids[:-1], out=is_first[1:])
    slot = torch.cumsum(is_first, 0) - 1  # slot of each sorted id among the unique ones
    unique = torch.zeros_like(sorted_ids)
    unique.scatter_(0, slot, sorted_ids)  # duplicates write the same value to the same slot
    inverse[order] = slot
    return FetchPlan(unique, slot[-1:] + 1, inverse)
