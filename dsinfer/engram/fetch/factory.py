"""Which placement a model's Engram tables get, and the fetcher that serves it.

**Choosing a placement** (:func:`resolve_placement`): the ``--engram-placement`` flag, else
``$DSINFER_ENGRAM_PLACEMENT``, else ``host`` when a GPU is present and the tables exceed the device
budget (``$DSINFER_ENGRAM_DEVICE_BUDGET_GIB``, default a quarter of the GPU's memory), else ``device``.
The host method: the ``host_method`` option, else ``$DSINFER_ENGRAM_HOST_METHOD``, else ``zero_copy``.
"""

from __future__ import annotations

from typing import Any

import torch

from dsinfer import envs
from dsinfer.config import ENGRAM_PLACEMENTS as PLACEMENTS
from dsinfer.engram.fetch.base import EngramFetcher
from dsinfer.engram.fetch.device import DeviceEngramFetcher
from dsinfer.engram.fetch.host import HOST_ONLY_OPTIONS, HostEngramFetcher
from dsinfer.engram.fetch.sharded import ShardedEngramFetcher
from dsinfer.engram.store import EngramStore

__all__ = ["DEVICE_BUDGET_ENV", "PLACEMENTS", "PLACEMENT_ENV", "make_engram_fetcher", "resolve_placement"]

PLACEMENT_ENV = envs.ENGRAM_PLACEMENT.name
DEVICE_BUDGET_ENV = envs.ENGRAM_DEVICE_BUDGET_GIB.name
DEFAULT_DEVICE_BUDGET_FRACTION = 0.25


def resolve_placement(
    requested: str | None,
    *,
    table_bytes: int,
    device: torch.device | str,
    device_memory_budget: int | None = None,
) -> str:
    """The placement to use: ``requested`` (the CLI flag), else ``$DSINFER_ENGRAM_PLACEMENT``, else the default.

    Default: ``host`` when ``device`` is a GPU and ``table_bytes`` exceed the device budget
    (``device_memory_budget``, else ``$DSINFER_ENGRAM_DEVICE_BUDGET_GIB``, else a quarter of the GPU's
    memory); otherwise ``device``.
    """
    if requested:
        value = requested.strip().lower()
        if value not in PLACEMENTS:
            raise ValueError(f"--engram-placement must be one of {', '.join(PLACEMENTS)}, got {value!r}")
        return value
    if envs.ENGRAM_PLACEMENT.get() is not None:
        return envs.ENGRAM_PLACEMENT.get()
    device = torch.device(device)
    if device.type != "cuda":
        return "device"
    if device_memory_budget is None:
        budget_gib = envs.ENGRAM_DEVICE_BUDGET_GIB.get()
        if budget_gib is not None:
            device_memory_budget = int(budget_gib * 2**30)
        else:
            total = torch.cuda.get_device_properties(device).total_memory
            device_memory_budget = int(total * DEFAULT_DEVICE_BUDGET_FRACTION)
    return "host" if table_bytes > device_memory_budget else "device"


def make_engram_fetcher(
    store: EngramStore,
    placement: str | None = None,
    *,
    device: torch.device | str,
    group: Any = None,
    device_memory_budget: int | None = None,
    host_method: str | None = None,
    **options: Any,
) -> EngramFetcher:
    """The fetcher of the resolved placement (:func:`resolve_placement`) over ``store``'s tables.

    ``host_method`` (:func:`resolve_host_method`) and the options in ``HOST_ONLY_OPTIONS`` apply to the
    host placement only; the other placements ignore them, so one set of options serves every placement.
    """
    table_bytes = sum(t.table_bytes for t in store.tables.values())
    placement = resolve_placement(
        placement, table_bytes=table_bytes, device=device, device_memory_budget=device_memory_budget
    )
    if placement == "host":
        return HostEngramFetcher.from_store(store, device, method=host_method, **options)
    options = {key: value for key, value in options.items() if key not in HOST_ONLY_OPTIONS}
    if placement == "device":
        return DeviceEngramFetcher.from_store(store, device, **options)
    tables = {layer: (store.weight(layer), store.scale(layer)) for layer in store.layer_ids}
    return ShardedEngramFetcher.from_tables(tables, group=group, device=device, **options)
