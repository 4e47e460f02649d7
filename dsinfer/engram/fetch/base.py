"""The fetcher interface every placement implements, and the gather from tables the device can read.

:class:`EngramFetcher` plans each fetch (:func:`~dsinfer.engram.fetch.plan.plan_fetch`), gathers and
dequantises the rows (the Triton kernel on CUDA, the torch reference otherwise) and expands them to
the request's shape; :meth:`EngramFetcher.start` / :meth:`EngramFetcher.wait` prefetch on a side
stream. The placements (:mod:`~dsinfer.engram.fetch.device`, :mod:`~dsinfer.engram.fetch.host`,
:mod:`~dsinfer.engram.fetch.sharded`) change where the rows come from.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from dsinfer.engram.fetch.plan import FetchPlan, plan_fetch
from dsinfer.kernels.engram_gather import (
    DEFAULT_BLOCK_ROWS,
    DEFAULT_NUM_WARPS,
    GatherLaunch,
    gather_dequantize,
    gather_dequantize_reference,
)
from dsinfer.ops.triton_support import triton_available

__all__ = ["DEDUP_MIN_IDS_CUDA", "EngramFetcher", "FetchSettings"]

DEDUP_MIN_IDS_CUDA = 65_536
"""Below this many ids a CUDA fetch gathers in request order: sorting costs more than it saves there."""


@dataclass(frozen=True)
class FetchSettings:
    """How a fetcher plans and gathers, whatever its placement.

    ``dedup`` (implies ``sort``) and ``sort`` control the plan, used for fetches of at least ``dedup_min_ids`` ids
    (None: 65,536 on CUDA, every fetch on CPU); ``max_programs``, ``block_rows`` and ``num_warps`` shape the
    Triton gather (:class:`~dsinfer.ops.engram_gather.kernel.GatherLaunch`), ``prefetch_programs`` caps the
    programs of gathers issued by :meth:`EngramFetcher.start` so the overlapped compute keeps most SMs;
    ``use_kernel`` None: the kernel wherever CUDA and Triton are.
    """

    out_dtype: torch.dtype = torch.bfloat16
    dedup: bool = True
    sort: bool = True
    max_programs: int | None = None
    prefetch_programs: int | None = None
    block_rows: int = DEFAULT_BLOCK_ROWS
    num_warps: int = DEFAULT_NUM_WARPS
    use_kernel: bool | None = None
    dedup_min_ids: int | None = None


class EngramFetcher:
    """Dequantised Engram rows for row ids, from tables that one placement holds.

    ``tables`` maps a layer id to ``(weight [rows, 256] uint8, scale [rows, 8] uint8)`` in memory
    the fetch path can read (device memory, or host memory a CUDA tensor aliases, or CPU memory on
    CPU). ``settings`` are the fields of :class:`FetchSettings` by name: the placements and the factory
    pass one set of keyword options through.
    """

    placement = "device"

    def __init__(
        self, tables: Mapping[int, tuple[torch.Tensor, torch.Tensor]], *, device: torch.device | str, **settings: Any
    ):
        if not tables:
            raise ValueError("an Engram fetcher needs at least one table")
        chosen = FetchSettings(**settings)
        self.tables = dict(tables)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.out_dtype = chosen.out_dtype
        self.dedup, self.sort = chosen.dedup, chosen.sort or chosen.dedup
        self.max_programs, self.prefetch_programs = chosen.max_programs, chosen.prefetch_programs
        self.block_rows, self.num_warps = chosen.block_rows, chosen.num_warps
        on_cuda = self.device.type == "cuda"
        self.use_kernel = (on_cuda and triton_available()) if chosen.use_kernel is None else chosen.use_kernel
        dedup_min_ids = chosen.dedup_min_ids
        self.dedup_min_ids = (DEDUP_MIN_IDS_CUDA if on_cuda else 0) if dedup_min_ids is None else dedup_min_ids
        if self.use_kernel and not (on_cuda and triton_available()):
            raise ValueError("use_kernel=True needs a CUDA device and Triton")
        self._stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._pending: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}

    # ------------------------------------------------------------------ public API
    @property
    def layer_ids(self) -> list[int]:
        return sorted(self.tables)

    def rows(self, layer_id: int) -> int:
        """Rows of ``layer_id``'s whole table (all shards together)."""
        return self._table(layer_id)[0].shape[0]

    def fetch(self, row_ids: torch.Tensor, layer_id: int | None = None, *, programs: int | None = None) -> torch.Tensor:
        """``[*row_ids.shape, 256]`` dequantised rows, computed now on the current stream."""
        if layer_id is None:
            if len(self.tables) != 1:
                raise ValueError(f"layer_id is required: this fetcher holds tables of layers {self.layer_ids}")
            layer_id = next(iter(self.tables))
        self._table(layer_id)
        row_ids = self._check_ids(row_ids, layer_id)
        plan = self._plan(row_ids)
        rows = self._gather(layer_id, plan, programs or self.max_programs)
        if plan.inverse is not None:
            rows = rows.index_select(0, plan.inverse)
        return rows.view(*row_ids.shape, rows.shape[-1])

    def start(self, row_ids_per_layer: Mapping[int, torch.Tensor]) -> None:
        """Issue the gathers of every layer in ``row_ids_per_layer`` (on a side stream on CUDA), earliest first.

        Call at the start of a step, after the ids are computed; :meth:`wait` collects each layer's
        rows. A layer started again before :meth:`wait` replaces its earlier request.
        """
        for layer_id in row_ids_per_layer:
            self._table(layer_id)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with self._on_side_stream():
            for layer_id in sorted(row_ids_per_layer):
                row_ids = row_ids_per_layer[layer_id]
                if self._stream is not None and row_ids.device == self.device:
                    row_ids.record_stream(self._stream)
                self._pending[layer_id] = self._start_layer(layer_id, row_ids)

    def wait(self, layer_id: int) -> torch.Tensor:
        """The rows :meth:`start` issued for ``layer_id``; the current stream waits for them (no host sync)."""
        if layer_id not in self._pending:
            raise KeyError(f"no prefetch pending for Engram layer {layer_id}: call start() first")
        rows, done = self._pending.pop(layer_id)
        if done is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(done)
            rows.record_stream(stream)
        return rows

    def replays_in_graphs(self, max_ids: int) -> bool:
        """With the Triton gather a fetch never reads the device on the host (the plan keeps its count on the
        device); the torch path slices by the count on the host."""
        return bool(self.use_kernel)

    def close(self) -> None:
        """Drop pending prefetches and the tables' references."""
        self._pending.clear()

    # ------------------------------------------------------------------ internals
    def _start_layer(self, layer_id: int, row_ids: torch.Tensor) -> Any:
        """One layer of :meth:`start` (on the side stream): what :meth:`wait` collects, here ``(rows, done)``."""
        return self.fetch(row_ids, layer_id, programs=self.prefetch_programs), self._side_event()

    def _on_side_stream(self) -> AbstractContextManager[Any]:
        """Make the side stream current (CUDA); nothing on CPU, where every call runs synchronously."""
        return torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()

    def _side_event(self) -> torch.cuda.Event | None:
        """An event recorded on the side stream behind the work issued so far (None on CPU)."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def _plan(self, row_ids: torch.Tensor) -> FetchPlan:
        """Sorted and de-duplicated from ``dedup_min_ids`` ids on; below that, the ids in request order."""
        planned = row_ids.numel() >= self.dedup_min_ids
        return plan_fetch(row_ids.reshape(-1), dedup=self.dedup and planned, sort=self.sort and planned)

    def _table(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_id not in self.tables:
            raise KeyError(f"no Engram table for layer {layer_id} (tables: {self.layer_ids})")
        return self.tables[layer_id]

    def _check_ids(self, row_ids: torch.Tensor, layer_id: int) -> torch.Tensor:
        if not isinstance(row_ids, torch.Tensor) or row_ids.is_floating_point() or row_ids.dtype == torch.bool:
            raise ValueError("row_ids must be an integer tensor")
        row_ids = row_ids.to(device=self.device, dtype=torch.int64, non_blocking=True)
        rows = self.rows(layer_id)
        if row_ids.numel() == 0:
            return row_ids
        if self.device.type == "cuda":  # checked on the device: a bad id stops the program, no host sync
            torch._assert_async((row_ids.min() >= 0) & (row_ids.max() < rows))
        elif int(row_ids.min()) < 0 or int(row_ids.max()) >= rows:
            raise ValueError(f"Engram row ids of layer {layer_id} must lie in [0, {rows})")
        return row_ids

    def _gather(self, layer_id: int, plan: FetchPlan, programs: int | None) -> torch.Tensor:
        """Dequantised rows of ``plan.ids[:count]``: ``[capacity, 256]`` with the kernel, ``[count, 256]`` without."""
        weight, scale = self._table(layer_id)
        return self._dequantize(weight, scale, plan.ids, plan.count, programs)

    def _dequantize(
        self, weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, count: torch.Tensor, programs: int | None
    ) -> torch.Tensor:
        if self.use_kernel:
            return self._kernel_gather(weight, scale, ids, count, programs)
        return gather_dequantize_reference(weight, scale, ids[: int(count)], self.out_dtype)

    def _kernel_gather(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        ids: torch.Tensor,
        count: torch.Tensor,
        programs: int | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The Triton gather of ``ids[:count]`` in this fetcher's output dtype and kernel shape."""
        return gather_dequantize(
            weight,
            scale,
            ids,
            count=count,
            out=out,
            out_dtype=self.out_dtype,
            launch=GatherLaunch(self.block_rows, self.num_warps, programs),
        )
