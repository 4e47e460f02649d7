"""Where a V4.1 model's Engram tables live, chosen at load time, and who closes them.

The release's two Engram tables take about 197 GB, more than a GPU holds next to the rest of the model.
``--engram-placement`` (:attr:`dsinfer.config.EngineConfig.engram_placement`, else
``$DSINFER_ENGRAM_PLACEMENT``, else :func:`dsinfer.engram.fetch.resolve_placement`'s default) picks:

* ``device``: the tables are loaded into the model's own :class:`~dsinfer.engram.module.EngramTable`
  buffers like any other weight (FP8 rows kept as stored), and read through
  :class:`~dsinfer.engram.module.EngramTableFetcher`;
* ``host``: the model holds no table. :func:`open_engram_tables` loads them from the checkpoint's
  safetensors into one shared-memory segment per host (:class:`~dsinfer.engram.store.EngramStore`:
  the lowest local rank loads, the others attach) and the GPU reads rows there in place
  (:class:`~dsinfer.engram.fetch.HostEngramFetcher`);
* ``sharded``: the model holds no table and no segment is made; each rank of the ``torch.distributed``
  group reads only its slice of every table from the checkpoint shards into device memory
  (:class:`~dsinfer.engram.fetch.ShardedEngramFetcher`; 1/N of 197 GB per rank, never the whole table
  anywhere) and a forward is collective: every rank must run one for each step.

**Lifetime.** :class:`PlacedEngramTables` owns the fetcher and the segment; the model it is attached to
owns it (:meth:`dsinfer.models.deepseek_v41.DeepseekV41.close`), and ``LLM.close()`` or the server's
shutdown closes the model. Closing unregisters the segment from CUDA and unmaps it. The segment's
*name* is gone long before that: the store unlinks it as soon as every local rank has attached (right
after loading in a single process), so a killed process leaves nothing in ``/dev/shm`` either (see
:mod:`dsinfer.engram.store` for the cases in between).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from dsinfer.config import FP8_SCALE_BLOCK, ModelConfigV41
from dsinfer.engram.fetch import (
    PLACEMENTS,
    EngramFetcher,
    ShardedEngramFetcher,
    make_engram_fetcher,
    resolve_placement,
    shard_bounds,
)
from dsinfer.engram.store import EngramStore, SafetensorsEngramSource, default_segment_name

__all__ = [
    "TABLES_OUTSIDE_MODEL",
    "EngramRowSource",
    "PlacedEngramTables",
    "check_placement",
    "choose_placement",
    "local_rank_and_size",
    "open_engram_tables",
]

TABLES_OUTSIDE_MODEL = ("host", "sharded")
"""Placements whose tables are not materialised in the model."""
_COPYING_FETCHERS = ("device",)
"""Placements whose fetcher copies what it needs out of the segment, which can then be closed at once."""


class EngramRowSource(Protocol):
    """What a V4.1 model reads Engram rows through (an :class:`~dsinfer.engram.fetch.EngramFetcher` or alike)."""

    @property
    def layer_ids(self) -> list[int]: ...

    def rows(self, layer_id: int) -> int:
        """Rows of ``layer_id``'s whole table."""
        ...

    def start(self, row_ids_per_layer: Mapping[int, torch.Tensor]) -> None:
        """Begin fetching every listed layer's rows (at the start of a forward)."""
        ...

    def wait(self, layer_id: int) -> torch.Tensor:
        """``[*ids.shape, dim]`` dequantised rows of the ids :meth:`start` got for ``layer_id``."""
        ...

    def replays_in_graphs(self, max_ids: int) -> bool:
        """Whether fetches of up to ``max_ids`` ids per layer run on the device alone (no host read, no CPU
        thread), so a CUDA graph can record them and replay them with new ids."""
        ...

    def close(self) -> None: ...


def choose_placement(config: ModelConfigV41, requested: str | None, device: torch.device | str) -> str:
    """The placement to use for ``config``'s tables: ``requested``, else the environment, else the default.

    The default is ``host`` on a GPU whose memory budget the tables exceed, ``device`` otherwise
    (:func:`dsinfer.engram.fetch.resolve_placement`).
    """
    row_bytes = config.engram_head_dim + config.engram_head_dim // FP8_SCALE_BLOCK
    table_bytes = sum(config.engram_num_embeddings) * row_bytes
    return resolve_placement(requested, table_bytes=table_bytes, device=device)


def check_placement(placement: str | None) -> None:
    """Fail before anything is loaded when ``placement`` cannot work in this process.

    ``sharded`` splits the tables over the ranks of a ``torch.distributed`` process group, so one must be
    initialised (a single-rank one is fine); a lone process without a group should use ``host``.
    """
    if placement is not None and placement not in PLACEMENTS:
        raise ValueError(f"engram_placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if placement == "sharded" and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError(
            "engram_placement 'sharded' splits the Engram tables over the ranks of a torch.distributed process "
            "group, and none is initialised in this process; launch one process per rank (torchrun), or use "
            "'host' to keep one copy of the tables in host memory"
        )


def local_rank_and_size(group: Any = None) -> tuple[int, int]:
    """This process's rank among the ranks on its host, and how many there are.

    ``$LOCAL_RANK`` / ``$LOCAL_WORLD_SIZE`` (set by torchrun) when present; else, in a process group,
    the ranks whose host name matches this one's (in global rank order); else ``(0, 1)``.
    """
    rank, size = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if rank is not None and size is not None:
        try:
            local_rank, local_size = int(rank), int(size)
        except ValueError:
            raise ValueError(f"LOCAL_RANK / LOCAL_WORLD_SIZE must be integers, got {rank!r} / {size!r}") from None
        if not 0 <= local_rank < local_size:
            raise ValueError(f"LOCAL_RANK {local_rank} lies outside [0, LOCAL_WORLD_SIZE = {local_size})")
        return local_rank, local_size
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    hosts: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    here = hosts[dist.get_rank(group)]
    same_host = [index for index, host in enumerate(hosts) if host == here]
    return same_host.index(dist.get_rank(group)), len(same_host)


class PlacedEngramTables:
    """Engram tables kept outside the model: the placement's fetcher, and the shared-memory store behind it.

    Reads go to the fetcher (:meth:`start` / :meth:`wait`); :meth:`close` closes the fetcher first (it
    may hold a CUDA registration of the segment) and then the store. Idempotent.
    """

    def __init__(self, placement: str, fetcher: EngramFetcher, store: EngramStore | None) -> None:
        self.placement, self.fetcher, self.store = placement, fetcher, store

    @property
    def layer_ids(self) -> list[int]:
        return self.fetcher.layer_ids

    def rows(self, layer_id: int) -> int:
        return self.fetcher.rows(layer_id)

    def start(self, row_ids_per_layer: Mapping[int, torch.Tensor]) -> None:
        self.fetcher.start(row_ids_per_layer)

    def wait(self, layer_id: int) -> torch.Tensor:
        return self.fetcher.wait(layer_id)

    def replays_in_graphs(self, max_ids: int) -> bool:
        return self.fetcher.replays_in_graphs(max_ids)

    def close(self) -> None:
        self.fetcher.close()
        if self.store is not None:
            self.store.close()
            self.store = None

    def __repr__(self) -> str:
        return f"PlacedEngramTables({self.placement!r}, {self.store if self.store is not None else 'no segment'})"


def open_engram_tables(
    directory: str | os.PathLike[str],
    config: ModelConfigV41,
    placement: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    group: Any = None,
) -> PlacedEngramTables:
    """Load the checkpoint's Engram tables into this host's segment and build ``placement``'s fetcher.

    Every local rank calls this (collectively, for ``sharded`` and whenever a process group exists): the
    lowest loads the segment from the safetensors shards, the others attach to it. Rows come back in
    ``dtype`` on ``device``. The tables must be stored as FP8 e4m3 rows with ue8m0 scales (as released).
    """
    check_placement(placement)
    directory = Path(directory)
    layer_ids = list(config.engram_layer_ids)
    if placement == "sharded":
        return PlacedEngramTables(placement, _load_shards(directory, config, device, dtype, group), None)
    local_rank, local_size = local_rank_and_size(group)
    source = SafetensorsEngramSource.from_checkpoint(directory, layer_ids) if local_rank == 0 else None
    name = default_segment_name(str(directory.resolve()))
    store = EngramStore.open(name, source, local_rank=local_rank, local_world_size=local_size)
    try:
        _check_layout({layer: (t.rows, t.row_bytes) for layer, t in store.tables.items()}, config, directory)
        fetcher = make_engram_fetcher(store, placement, device=device, group=group, out_dtype=dtype)
        if placement in _COPYING_FETCHERS:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.barrier(group)  # every local rank has attached before the loader unmaps
            store.close()
            store = None
    except BaseException:
        if store is not None:
            store.close()
        raise
    return PlacedEngramTables(placement, fetcher, store)


def _load_shards(
    directory: Path, config: ModelConfigV41, device: torch.device | str, dtype: torch.dtype, group: Any
) -> ShardedEngramFetcher:
    """This rank's rows ``shard_bounds(rows, W)[r:r + 2]`` of every table, read straight from the shards."""
    dist = torch.distributed
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    source = SafetensorsEngramSource.from_checkpoint(directory, list(config.engram_layer_ids))
    _check_layout({spec.layer_id: (spec.rows, spec.row_bytes) for spec in source.table_specs()}, config, directory)
    device = torch.device(device)
    shards, rows = {}, {}
    for spec in source.table_specs():
        bounds = shard_bounds(spec.rows, world_size)
        weight, scale = source.read_rows(spec.layer_id, bounds[rank], bounds[rank + 1])
        shards[spec.layer_id] = (_rows(weight, spec.row_bytes, device), _rows(scale, spec.scale_columns, device))
        rows[spec.layer_id] = spec.rows
    return ShardedEngramFetcher(shards, rows, group=group, device=device, out_dtype=dtype)


def _rows(buffer: bytearray, columns: int, device: torch.device) -> torch.Tensor:
    """Raw table bytes as a ``uint8 [rows, columns]`` tensor on ``device`` (a rank may own no rows)."""
    if not buffer:
        return torch.empty(0, columns, dtype=torch.uint8, device=device)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(-1, columns).to(device)


def _check_layout(tables: Mapping[int, tuple[int, int]], config: ModelConfigV41, directory: Path) -> None:
    """The tables (layer -> rows, row bytes) have the shapes that config.json's Engram layout addresses."""
    for layer_id, rows in zip(config.engram_layer_ids, config.engram_num_embeddings, strict=True):
        table = tables.get(layer_id)
        if table is None or table != (rows, config.engram_head_dim):
            got = "no table" if table is None else f"[{table[0]}, {table[1]}]"
            raise ValueError(
                f"{directory}: layers.{layer_id}.engram.embed.weight is {got}, but config.json's Engram layout "
                f"needs [{rows}, {config.engram_head_dim}]"
            )
