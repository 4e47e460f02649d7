"""The ``host`` placement: the tables stay in the host's shared-memory segment, read by the GPU or staged by the CPU.

**Host methods compared** (``benchmarks/engram_fetch.py --suite staged``, sorted unique rows of 264 bytes,
16 host cores; the figures are in docs/perf.md, history, 2026-11-29, second round): the staged method is bound by
the host's memory system, not by translation, and its pipeline delivers most of what the CPU threads gather. On
a 64 GiB table ``split`` read the most (well ahead of zero-copy, still under half the pinned copy); on a 16 GiB
table, on a machine whose CPU gathered slowly, zero-copy read more than ``split``. Small fetches favour zero-copy
(staging costs a host round trip), hence ``split_min_ids``. Prefetched behind a 65,536-token prefill every method
adds about 1% of the step or less, within its noise. ``zero_copy`` stays the default: the same end-to-end cost,
no host threads, no host synchronisation; ``split`` is the faster choice for large fetches from V4.1-size tables
on a host with CPU to spare (``DSINFER_ENGRAM_HOST_METHOD=split``). No method reaches 70% of the pinned copy on
this machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Any

import torch

from dsinfer import envs
from dsinfer.engram.fetch.base import EngramFetcher
from dsinfer.engram.fetch.host_memory import HostRegistration, host_tensor
from dsinfer.engram.fetch.plan import FetchPlan
from dsinfer.engram.staged_gather import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_STAGING_BUFFERS,
    DEFAULT_STAGING_ROWS,
    StagedGather,
)
from dsinfer.engram.store import EngramStore, table_records
from dsinfer.kernels.engram_gather import (
    dequantize_reference,
    dequantize_rows,
    gather_dequantize_reference,
)

__all__ = [
    "DEFAULT_SPLIT_MIN_IDS",
    "DEFAULT_ZERO_COPY_SHARE",
    "HOST_METHODS",
    "HOST_METHOD_ENV",
    "HOST_ONLY_OPTIONS",
    "HostEngramFetcher",
    "HostReadSettings",
    "resolve_host_method",
]

HOST_GATHER_SHAPE = {"block_rows": 64, "num_warps": 8, "max_programs": 32, "prefetch_programs": 32}
"""Triton shape for host memory: few programs keep the rows in flight close together (see the kernel)."""
HOST_METHODS = ("zero_copy", "staged", "split")
HOST_METHOD_ENV = envs.ENGRAM_HOST_METHOD.name
DEFAULT_HOST_METHOD = "zero_copy"
"""Same prefetched step cost as the others on the H200, no host threads or synchronisation (module docstring)."""
DEFAULT_ZERO_COPY_SHARE = 0.5
"""Share of a ``split`` fetch's rows that the zero-copy kernel reads (the CPU stages the rest)."""
DEFAULT_SPLIT_MIN_IDS = 131_072
"""``split`` fetches of fewer ids are read all zero-copy: below this the host round trip costs more than it saves."""
SHARE_BITS = 10
"""The share is ``count * round(share * 2**SHARE_BITS) >> SHARE_BITS`` rows: the same integer on device and host."""


@dataclass(frozen=True)
class HostReadSettings:
    """How the ``staged`` and ``split`` methods read (:class:`HostEngramFetcher`): the zero-copy share of a split
    fetch and the size below which it is all zero-copy, and the CPU stager's lanes, chunk rows, buffer rows and
    buffers (:class:`~dsinfer.engram.staged_gather.StagedGather`)."""

    zero_copy_share: float = DEFAULT_ZERO_COPY_SHARE
    split_min_ids: int = DEFAULT_SPLIT_MIN_IDS
    staging_threads: int | None = None
    staging_chunk_rows: int = DEFAULT_CHUNK_ROWS
    staging_rows: int = DEFAULT_STAGING_ROWS
    staging_buffers: int = DEFAULT_STAGING_BUFFERS


READ_OPTIONS = tuple(field.name for field in fields(HostReadSettings))
HOST_ONLY_OPTIONS = ("scales_on_device", *READ_OPTIONS)
"""Options of the host placement that :func:`~dsinfer.engram.fetch.factory.make_engram_fetcher` leaves out for the
other placements."""


def resolve_host_method(requested: str | None) -> str:
    """How the host placement reads its tables: ``requested``, else ``$DSINFER_ENGRAM_HOST_METHOD``, else the default.

    ``zero_copy``: the GPU reads the registered segment itself; ``staged``: CPU threads gather the rows
    and the GPU receives them as large copies; ``split``: both at once, each on a share of the rows.
    ``-`` may stand for ``_``.
    """
    if requested:
        value = requested.strip().lower().replace("-", "_")
        if value not in HOST_METHODS:
            raise ValueError(f"host_method must be one of {', '.join(HOST_METHODS)}, got {value!r}")
        return value
    return envs.ENGRAM_HOST_METHOD.get() or DEFAULT_HOST_METHOD


class HostEngramFetcher(EngramFetcher):
    """``host`` placement: the tables stay in the shared-memory segment; ``method`` says how rows reach the GPU.

    ``zero_copy``: the whole segment is registered once (``cudaHostRegister``), each table is a CUDA
    tensor aliasing it, and the gather kernel reads the rows over PCIe. ``scales_on_device`` copies
    the small scale tables (3 GB each for V4.1) to device memory, which saves one small PCIe read per
    row.

    ``staged``: the tables are the store's CPU tensors (nothing is registered); a
    :class:`~dsinfer.engram.staged_gather.StagedGather` (``staging_threads`` lanes gathering chunks of
    ``staging_chunk_rows`` rows into ``staging_buffers`` pinned buffers of ``staging_rows`` rows)
    gathers the rows on the CPU and copies them over in large pieces; the GPU dequantises them.
    :meth:`fetch` waits for the ids to reach the host; :meth:`start` does not (a worker thread does).

    ``split``: both at once, since they are bound by different things (the device's address
    translation; the host's memory system): the zero-copy kernel reads the first ``zero_copy_share``
    of each fetch's sorted rows on a stream of its own while the CPU stages the rest. Fetches of
    fewer than ``split_min_ids`` ids are read all zero-copy (no host round trip). ``tables`` are the
    registered CUDA views, ``host_tables`` the same tables as CPU tensors.

    On CPU every method runs its pipeline in memory (the zero-copy share through the reference).
    ``method`` defaults to :func:`resolve_host_method`'s choice.
    """

    placement = "host"

    def __init__(
        self,
        tables: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
        *,
        store: EngramStore | None = None,
        registration: HostRegistration | None = None,
        method: str | None = None,
        host_tables: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
        **options: Any,
    ):
        """``options``: the fields of :class:`HostReadSettings` and of :class:`~dsinfer.engram.fetch.base.FetchSettings`
        by name (the host placement's gather shape is the default on CUDA)."""
        reading = HostReadSettings(**{name: options.pop(name) for name in READ_OPTIONS if name in options})
        if torch.device(options["device"]).type == "cuda":
            for key, value in HOST_GATHER_SHAPE.items():
                options.setdefault(key, value)
        super().__init__(tables, **options)
        self.store = store
        self.registration = registration
        self.method = resolve_host_method(method)
        self.host_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._share_parts = 0
        self.split_min_ids = reading.split_min_ids
        self._stager: StagedGather | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._split_stream: torch.cuda.Stream | None = None
        if self.method == "zero_copy":
            return
        if self.method == "split":
            if not 0.0 <= reading.zero_copy_share <= 1.0:
                raise ValueError(f"zero_copy_share must lie in [0, 1], got {reading.zero_copy_share}")
            self._share_parts = round(reading.zero_copy_share * (1 << SHARE_BITS))
            if self.device.type == "cuda":
                if not self.use_kernel:
                    raise ValueError("the split host method needs the Triton gather kernel on CUDA")
                self._split_stream = torch.cuda.Stream(self.device)
        self.host_tables = dict(self.tables if host_tables is None else host_tables)
        self._check_host_tables()
        weight, scale = next(iter(self.host_tables.values()))
        self._stager = StagedGather(
            self.device,
            threads=reading.staging_threads,
            chunk_rows=reading.staging_chunk_rows,
            staging_rows=reading.staging_rows,
            buffers=reading.staging_buffers,
            row_bytes=weight.shape[1],
            scale_columns=scale.shape[1],
        )
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="engram-prefetch", initializer=self._enter_device)

    @classmethod
    def from_store(
        cls,
        store: EngramStore,
        device: torch.device | str,
        *,
        scales_on_device: bool = False,
        method: str | None = None,
        **options: Any,
    ) -> HostEngramFetcher:
        device = torch.device(device)
        method = resolve_host_method(method)
        if scales_on_device and method != "zero_copy":
            raise ValueError(f"scales_on_device applies to the zero_copy host method, not {method}")
        host_tables = {layer: (store.weight(layer), store.scale(layer)) for layer in store.layer_ids}
        if device.type != "cuda" or method == "staged":
            return cls(host_tables, store=store, device=device, method=method, **options)
        registration = HostRegistration(store.address, store.nbytes, device)
        try:
            segment = host_tensor(store.address, store.nbytes, device)
            tables = {}
            for layer_id, table in store.tables.items():
                records = table_records(segment, table)
                weight, scale = records[:, : table.row_bytes], records[:, table.row_bytes :]
                if scales_on_device:
                    scale = store.scale(layer_id).to(device, memory_format=torch.contiguous_format)
                tables[layer_id] = (weight, scale)
            if method == "split":
                options["host_tables"] = host_tables
            return cls(tables, store=store, registration=registration, device=device, method=method, **options)
        except BaseException:
            registration.close()
            raise

    def wait(self, layer_id: int) -> torch.Tensor:
        pending = self._pending.get(layer_id)
        if isinstance(pending, Future):
            try:
                self._pending[layer_id] = pending.result()  # this layer's CPU gather is done, its GPU work enqueued
            except BaseException:
                del self._pending[layer_id]
                raise
        return super().wait(layer_id)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)  # no thread may read the tables after this
            self._worker = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        super().close()
        self.tables.clear()
        self.host_tables.clear()
        if self.registration is not None:
            torch.cuda.synchronize(self.device)
            self.registration.close()
            self.registration = None

    # ------------------------------------------------------------------ staged and split methods
    def _check_host_tables(self) -> None:
        if set(self.host_tables) != set(self.tables):
            raise ValueError(f"host_tables hold layers {sorted(self.host_tables)}, the tables {self.layer_ids}")
        for layer_id, (weight, scale) in self.host_tables.items():
            for name, table in (("weight", weight), ("scale", scale)):
                if table.device.type != "cpu" or table.dtype != torch.uint8 or table.dim() != 2 or table.stride(1) != 1:
                    raise ValueError(
                        f"the {self.method} host method reads uint8 tables with contiguous rows in host memory; "
                        f"layer {layer_id}'s {name} is {table.dtype} {tuple(table.shape)} with strides "
                        f"{table.stride()} on {table.device}"
                    )

    def _enter_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _start_layer(self, layer_id: int, row_ids: torch.Tensor) -> Any:
        """Plan on the side stream and hand the rest to the worker thread (a future of ``(rows, done)``)."""
        if self._reads_zero_copy(row_ids.numel()):
            return super()._start_layer(layer_id, row_ids)
        row_ids = self._check_ids(row_ids, layer_id)
        plan = self._plan(row_ids)
        share = self._begin_zero_copy_share(layer_id, plan, self.prefetch_programs)
        ids, count, ready = plan.ids, plan.count, None
        if self._stream is not None:  # the ids go to the host on the side stream; the worker waits for them
            ids = torch.empty(plan.ids.shape, dtype=torch.int64, pin_memory=True)
            count = torch.empty(1, dtype=torch.int64, pin_memory=True)
            ids.copy_(plan.ids, non_blocking=True)
            count.copy_(plan.count, non_blocking=True)
            ready = self._side_event()
        return self._worker.submit(self._prefetch, layer_id, plan, share, ids, count, ready, tuple(row_ids.shape))

    def replays_in_graphs(self, max_ids: int) -> bool:
        """Only fetches the zero-copy kernel reads alone: staging waits for the ids on the host."""
        return self._reads_zero_copy(max_ids) and super().replays_in_graphs(max_ids)

    def _reads_zero_copy(self, ids: int) -> bool:
        """Whether a fetch of ``ids`` ids takes the zero-copy path alone (a small ``split`` fetch)."""
        return self.method == "zero_copy" or (self.method == "split" and ids < self.split_min_ids)

    def _gather(self, layer_id: int, plan: FetchPlan, programs: int | None) -> torch.Tensor:
        if self._reads_zero_copy(plan.ids.numel()):
            return super()._gather(layer_id, plan, programs)
        share = self._begin_zero_copy_share(layer_id, plan, programs)  # runs on the device during the CPU gather
        ids = plan.ids[: int(plan.count)].cpu()  # a host synchronisation: the CPU gathers by these ids
        stream = torch.cuda.current_stream(self.device) if self._stream is not None else None
        return self._finish(layer_id, ids, ids.numel(), share, stream)

    def _begin_zero_copy_share(
        self, layer_id: int, plan: FetchPlan, programs: int | None
    ) -> tuple[torch.Tensor, torch.cuda.Event] | None:
        """Start the zero-copy share of a split fetch on its own stream, without a host synchronisation.

        Returns ``(rows, done)``: ``rows`` [capacity, 256] receives rows ``[0, k)`` of the plan, ``k``
        being ``count * share`` computed on the device, and ``done`` is recorded behind the kernel.
        ``None`` where nothing is shared out (staged; split on CPU does its share in :meth:`_finish`).
        """
        if self._split_stream is None or not self._share_parts:
            return None
        stream = torch.cuda.current_stream(self.device)
        weight, scale = self._table(layer_id)
        rows = torch.empty(plan.ids.numel(), weight.shape[1], dtype=self.out_dtype, device=self.device)
        shared = (plan.count * self._share_parts) >> SHARE_BITS
        self._split_stream.wait_stream(stream)
        with torch.cuda.stream(self._split_stream):
            self._kernel_gather(weight, scale, plan.ids, shared, programs, out=rows)
            done = torch.cuda.Event()
            done.record(self._split_stream)
        for tensor in (rows, plan.ids, shared):
            tensor.record_stream(self._split_stream)
        return rows, done

    def _finish(
        self,
        layer_id: int,
        ids: torch.Tensor,
        count: int,
        share: tuple[torch.Tensor, torch.cuda.Event] | None,
        stream: torch.cuda.Stream | None,
    ) -> torch.Tensor:
        """Dequantised rows of ``ids[:count]`` (host ids): the staged rows, after the zero-copy share if any.

        The CPU gathers rows ``[k, count)``, the copies and the dequantisation run on ``stream`` (the
        current one), which then waits for the zero-copy share.
        """
        shared = (count * self._share_parts) >> SHARE_BITS
        weight, scale = self.host_tables[layer_id]
        codes, scales = self._stager.gather(weight, scale, ids[shared:count], stream=stream)
        if share is not None:
            rows, done = share
        else:
            rows = torch.empty(count, weight.shape[1], dtype=self.out_dtype, device=self.device)
            if shared:  # split on CPU: the zero-copy share through the reference
                rows[:shared] = gather_dequantize_reference(*self._table(layer_id), ids[:shared], self.out_dtype)
            done = None
        staged = rows[shared:count]
        if self.use_kernel:
            dequantize_rows(codes, scales, out=staged, out_dtype=self.out_dtype)
        else:
            staged.copy_(dequantize_reference(codes, scales, self.out_dtype))
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        return rows

    def _prefetch(
        self,
        layer_id: int,
        plan: FetchPlan,
        share: tuple[torch.Tensor, torch.cuda.Event] | None,
        ids: torch.Tensor,
        count: torch.Tensor,
        ready: torch.cuda.Event | None,
        shape: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """One layer of :meth:`start`, on the worker thread: the rest of the fetch of ``plan`` (GPU: side stream)."""
        with self._on_side_stream():
            if ready is not None:
                ready.synchronize()  # the plan's ids and count are on the host
            count = int(count)
            rows = self._finish(layer_id, ids, count, share, self._stream)
            rows = rows.index_select(0, plan.inverse) if plan.inverse is not None else rows[:count]
            return rows.view(*shape, rows.shape[-1]), self._side_event()
