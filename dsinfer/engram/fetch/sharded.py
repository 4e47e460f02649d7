"""The ``sharded`` placement: each rank holds a contiguous slice of every table; a fetch is collective."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dsinfer.engram.fetch.base import EngramFetcher
from dsinfer.engram.fetch.plan import FetchPlan

__all__ = ["ShardedEngramFetcher", "shard_bounds"]


def shard_bounds(rows: int, world_size: int) -> list[int]:
    """First row of each rank's shard plus ``rows`` at the end: rank r holds ``[b[r], b[r + 1])``."""
    return [rows * rank // world_size for rank in range(world_size + 1)]


class ShardedEngramFetcher(EngramFetcher):
    """``sharded`` placement: this rank holds rows ``shard_bounds(rows, W)[r:r + 2]`` of every table.

    A fetch is collective: every rank of ``group`` must call :meth:`fetch` (or :meth:`start`) for the
    same layers in the same order, with its own ids (possibly none). Ids go to their owners, raw FP8
    rows and scales come back (264 bytes a row, half of what bf16 rows would take), and the
    requesting rank dequantises.
    """

    placement = "sharded"

    def __init__(
        self,
        shards: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
        table_rows: Mapping[int, int],
        *,
        group: Any = None,
        **options: Any,
    ):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("the 'sharded' Engram placement needs an initialised torch.distributed process group")
        options["sort"] = True  # owners' ranges are contiguous, so sorted ids arrive grouped by owner
        options["dedup_min_ids"] = 0
        super().__init__(shards, **options)
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.table_rows = {int(layer): int(rows) for layer, rows in table_rows.items()}
        for layer_id, (weight, scale) in self.tables.items():
            bounds = shard_bounds(self.table_rows[layer_id], self.world_size)
            expected = bounds[self.rank + 1] - bounds[self.rank]
            if weight.shape[0] != expected or scale.shape[0] != expected:
                raise ValueError(
                    f"rank {self.rank} must hold {expected} rows of layer {layer_id}'s table, got {weight.shape[0]}"
                )

    @classmethod
    def from_tables(
        cls, tables: Mapping[int, tuple[torch.Tensor, torch.Tensor]], *, group: Any = None, **options: Any
    ) -> ShardedEngramFetcher:
        """Keep this rank's shard of full tables (copied to ``options['device']``)."""
        import torch.distributed as dist

        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        device = torch.device(options["device"])
        shards, rows = {}, {}
        for layer_id, (weight, scale) in tables.items():
            bounds = shard_bounds(weight.shape[0], world_size)
            lo, hi = bounds[rank], bounds[rank + 1]
            shards[layer_id] = (weight[lo:hi].to(device, copy=True), scale[lo:hi].to(device, copy=True))
            rows[layer_id] = weight.shape[0]
        return cls(shards, rows, group=group, **options)

    def replays_in_graphs(self, max_ids: int) -> bool:
        """Never: the exchange sizes are read on the host."""
        return False

    def rows(self, layer_id: int) -> int:
        self._table(layer_id)
        return self.table_rows[layer_id]

    def _gather(self, layer_id: int, plan: FetchPlan, programs: int | None) -> torch.Tensor:
        import torch.distributed as dist

        weight, scale = self._table(layer_id)
        wanted = plan.ids[: int(plan.count)]  # the exchange sizes must be known on the host
        bounds = torch.tensor(shard_bounds(self.table_rows[layer_id], self.world_size), device=self.device)
        owners = torch.bucketize(wanted, bounds[1:-1], right=True)
        send_counts = torch.bincount(owners, minlength=self.world_size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        asked = torch.empty(sum(recv_splits), dtype=torch.int64, device=self.device)
        dist.all_to_all_single(asked, wanted, recv_splits, send_splits, group=self.group)
        local = asked - bounds[self.rank]
        codes, scales = weight.index_select(0, local), scale.index_select(0, local)
        got_codes = torch.empty(wanted.numel(), weight.shape[1], dtype=weight.dtype, device=self.device)
        got_scales = torch.empty(wanted.numel(), scale.shape[1], dtype=scale.dtype, device=self.device)
        dist.all_to_all_single(got_codes, codes, send_splits, recv_splits, group=self.group)
        dist.all_to_all_single(got_scales, scales, send_splits, recv_splits, group=self.group)
        identity = torch.arange(wanted.numel(), device=self.device)
        count = torch.full((1,), wanted.numel(), dtype=torch.int64, device=self.device)
        return self._dequantize(got_codes, got_scales, identity, count, programs)
