"""The ``device`` placement: private copies of the Engram tables in device memory."""

from __future__ import annotations

from typing import Any

import torch

from dsinfer.engram.fetch.base import EngramFetcher
from dsinfer.engram.store import EngramStore

__all__ = ["DeviceEngramFetcher"]


class DeviceEngramFetcher(EngramFetcher):
    """``device`` placement: private copies of the tables in device memory (CPU memory on CPU)."""

    placement = "device"

    @classmethod
    def from_store(cls, store: EngramStore, device: torch.device | str, **options: Any) -> DeviceEngramFetcher:
        device = torch.device(device)
        tables = {}
        for layer_id in store.layer_ids:
            weight, scale = store.weight(layer_id), store.scale(layer_id)
            # Contiguous private copies (the store's are column ranges of its records).
            tables[layer_id] = (
                weight.to(device, memory_format=torch.contiguous_format, copy=True),
                scale.to(device, memory_format=torch.contiguous_format, copy=True),
            )
        return cls(tables, device=device, **options)
