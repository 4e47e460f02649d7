"""Fetch Engram rows for a step: three placements of the tables behind one interface, with prefetch.

:class:`EngramFetcher` turns row ids ``[T, k]`` (from :meth:`dsinfer.engram.hashing.EngramHasher.row_ids`)
into dequantised rows ``[T, k, 256]``. Every placement does the same three things:

1. **Plan** (:func:`plan_fetch`): sort the step's ids and drop duplicates (n-gram hashes of real text
   repeat a lot), keeping the inverse map. Sorting also orders the reads by address, which is what
   makes host reads fast (neighbouring rows share pages, so the GPU's and the IOMMU's translation
   caches hit). The plan needs no host synchronisation: the number of unique ids stays on the device.
2. **Gather** the unique rows and dequantise them (``code * 2**(scale - 127)``, exact):

   * ``device``: the tables sit in GPU memory (small models, or a big GPU budget).
   * ``host``: the tables stay in the host's shared-memory segment (:mod:`dsinfer.engram.store`).
     Three methods read them (:func:`resolve_host_method`): ``zero_copy`` registers the segment with
     ``cudaHostRegister`` and a Triton kernel (:mod:`dsinfer.kernels.engram_gather`) reads the rows
     straight over PCIe, dequantising on the fly; ``staged`` has CPU threads gather the rows into
     pinned buffers that reach the GPU as a few large copies (:mod:`dsinfer.engram.staged_gather`),
     then dequantises them there; ``split`` does both at once on two shares of each large fetch.
     Staging needs the ids on the host: one small device-to-host copy per layer.
   * ``sharded``: each rank holds rows ``[r * N / W, (r + 1) * N / W)`` of every table; a step sends
     each owner the ids it holds and gets the raw FP8 rows back through two ``all_to_all_single``
     calls (the upstream DeepInfer layout, over ``torch.distributed`` instead of RDMA reads).
3. **Expand** with the inverse map to ``[T, k, 256]``.

On CPU all three run the torch reference (:func:`dsinfer.kernels.engram_gather.gather_dequantize_reference`);
outputs are bit-identical across placements because the dequantisation is exact and ends in one
rounding to the output dtype.

**Prefetch.** :meth:`EngramFetcher.start` takes the ids of every Engram layer at the start of a step
and issues the gathers on a side CUDA stream, earliest layer first; :meth:`EngramFetcher.wait` makes
the compute stream wait for one layer's rows right before that layer. On CPU the same calls run
synchronously. The staged and split host methods plan on the side stream too (split also starts its
zero-copy share there), then hand each layer to a worker thread that waits for the ids to reach the
host and runs the CPU gather, the copies and the dequantisation; ``start`` returns at once and
``wait`` joins that layer's work (on CPU as well).

**What it costs** (H200, PCIe 5, 55 GB/s pinned copy; ``benchmarks/engram_fetch.py``, docs/perf.md):
scattered host reads are translation-bound (5.5 GB/s for random rows of a 16 GiB table), sorting
and de-duplication bring a 65,536-token prefill's two layers from 104 ms to 21 ms, and prefetched
behind the first layers with 32 programs the host placement added 2.4 ms (0.2%) to a 1.4 s step.
Small fetches (decode) skip the plan: below ``dedup_min_ids`` (65,536 ids on CUDA) its kernels
cost more than the duplicate rows they save.

**Host methods compared** (``--suite staged``, sorted unique rows, GB/s of the 264-byte rows, same
run, 16 host cores): the staged method is bound by the host's memory system, not by translation:
16 threads gather random rows at 8.6-27 GB/s depending on the machine, and the staged pipeline
delivers 80-90% of that. At 524,288 rows of a 64 GiB table zero-copy reads 11.5, staged 13-17 and
split 18.6-20.9 GB/s (34-38% of the pinned copy, 1.6-1.8x zero-copy); on a 16 GiB table zero-copy
reads 19.4 and split 12.1 (a machine whose CPU gathered at 8.6 GB/s). Below 131,072 ids zero-copy
is faster (staging costs 0.7-2 ms of host round trip), hence ``split_min_ids``. Prefetched behind a
65,536-token prefill every method adds 3-15 ms (0.2-1.1%, within the step's noise). ``zero_copy``
stays the default: the same end-to-end cost, no host threads, no host synchronisation; ``split``
is the faster choice for large fetches from V4.1-size tables on a host with CPU to spare
(``DSINFER_ENGRAM_HOST_METHOD=split``). No method reaches 70% of the pinned copy on this machine.

**Choosing a placement** (:func:`resolve_placement`): the ``--engram-placement`` flag, else
``$DSINFER_ENGRAM_PLACEMENT``, else ``host`` when a GPU is present and the tables exceed the device
budget (``$DSINFER_ENGRAM_DEVICE_BUDGET_GIB``, default a quarter of the GPU's memory), else ``device``.
The host method: the ``host_method`` option, else ``$DSINFER_ENGRAM_HOST_METHOD``, else ``zero_copy``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext as _no_stream
from dataclasses import dataclass
from typing import Any

import torch

from dsinfer.engram.staged_gather import (
    DEFAULT_CHUNK_ROWS,
    DEFAULT_STAGING_BUFFERS,
    DEFAULT_STAGING_ROWS,
    StagedGather,
)
from dsinfer.engram.store import EngramStore, table_records
from dsinfer.kernels.engram_gather import (
    DEFAULT_BLOCK_ROWS,
    DEFAULT_NUM_WARPS,
    dequantize_reference,
    dequantize_rows,
    gather_dequantize,
    gather_dequantize_reference,
    triton_available,
)

__all__ = [
    "DEVICE_BUDGET_ENV",
    "HOST_METHODS",
    "HOST_METHOD_ENV",
    "PLACEMENTS",
    "PLACEMENT_ENV",
    "DeviceEngramFetcher",
    "EngramFetcher",
    "FetchPlan",
    "HostEngramFetcher",
    "HostRegistration",
    "ShardedEngramFetcher",
    "host_tensor",
    "make_engram_fetcher",
    "plan_fetch",
    "resolve_host_method",
    "resolve_placement",
    "shard_bounds",
]

PLACEMENTS = ("device", "host", "sharded")
PLACEMENT_ENV = "DSINFER_ENGRAM_PLACEMENT"
DEVICE_BUDGET_ENV = "DSINFER_ENGRAM_DEVICE_BUDGET_GIB"
DEFAULT_DEVICE_BUDGET_FRACTION = 0.25
DEDUP_MIN_IDS_CUDA = 65_536
"""Below this many ids a CUDA fetch gathers in request order: sorting costs more than it saves there."""
HOST_GATHER_SHAPE = {"block_rows": 64, "num_warps": 8, "max_programs": 32, "prefetch_programs": 32}
"""Triton shape for host memory: few programs keep the rows in flight close together (see the kernel)."""
HOST_METHODS = ("zero_copy", "staged", "split")
HOST_METHOD_ENV = "DSINFER_ENGRAM_HOST_METHOD"
DEFAULT_HOST_METHOD = "zero_copy"
"""Same prefetched step cost as the others on the H200, no host threads or synchronisation (module docstring)."""
HOST_ONLY_OPTIONS = (
    "scales_on_device",
    "zero_copy_share",
    "split_min_ids",
    "staging_threads",
    "staging_chunk_rows",
    "staging_rows",
    "staging_buffers",
)
"""Options of the host placement that :func:`make_engram_fetcher` leaves out for the other placements."""
DEFAULT_ZERO_COPY_SHARE = 0.5
"""Share of a ``split`` fetch's rows that the zero-copy kernel reads (the CPU stages the rest)."""
DEFAULT_SPLIT_MIN_IDS = 131_072
"""``split`` fetches of fewer ids are read all zero-copy: below this the host round trip costs more than it saves."""
SHARE_BITS = 10
"""The share is ``count * round(share * 2**SHARE_BITS) >> SHARE_BITS`` rows: the same integer on device and host."""


# ------------------------------------------------------------------------------------------ placement
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
    for value, where in ((requested, "--engram-placement"), (os.environ.get(PLACEMENT_ENV), PLACEMENT_ENV)):
        if value:
            value = value.strip().lower()
            if value not in PLACEMENTS:
                raise ValueError(f"{where} must be one of {', '.join(PLACEMENTS)}, got {value!r}")
            return value
    device = torch.device(device)
    if device.type != "cuda":
        return "device"
    if device_memory_budget is None:
        raw = os.environ.get(DEVICE_BUDGET_ENV)
        if raw:
            try:
                device_memory_budget = int(float(raw) * 2**30)
            except ValueError:
                raise ValueError(f"{DEVICE_BUDGET_ENV} must be a number of GiB, got {raw!r}") from None
        else:
            total = torch.cuda.get_device_properties(device).total_memory
            device_memory_budget = int(total * DEFAULT_DEVICE_BUDGET_FRACTION)
    return "host" if table_bytes > device_memory_budget else "device"


def resolve_host_method(requested: str | None) -> str:
    """How the host placement reads its tables: ``requested``, else ``$DSINFER_ENGRAM_HOST_METHOD``, else the default.

    ``zero_copy``: the GPU reads the registered segment itself; ``staged``: CPU threads gather the rows
    and the GPU receives them as large copies; ``split``: both at once, each on a share of the rows.
    ``-`` may stand for ``_``.
    """
    for value, where in ((requested, "host_method"), (os.environ.get(HOST_METHOD_ENV), HOST_METHOD_ENV)):
        if value:
            value = value.strip().lower().replace("-", "_")
            if value not in HOST_METHODS:
                raise ValueError(f"{where} must be one of {', '.join(HOST_METHODS)}, got {value!r}")
            return value
    return DEFAULT_HOST_METHOD


def shard_bounds(rows: int, world_size: int) -> list[int]:
    """First row of each rank's shard plus ``rows`` at the end: rank r holds ``[b[r], b[r + 1])``."""
    return [rows * rank // world_size for rank in range(world_size + 1)]


# ------------------------------------------------------------------------------------------ plan
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


# ------------------------------------------------------------------------------------------ host memory
class _CudaArrayInterface:
    """A byte range of (registered) host memory described by ``__cuda_array_interface__``."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def host_tensor(address: int, nbytes: int, device: torch.device | str) -> torch.Tensor:
    """A CUDA uint8 tensor aliasing ``nbytes`` of registered host memory at ``address`` (UVA, no copy).

    Kernels that read it fetch the bytes over PCIe; it works because a registered host range has the
    same address on the GPU under unified virtual addressing.
    """
    device = torch.device(device)
    with torch.cuda.device(device):
        return torch.as_tensor(_CudaArrayInterface(address, nbytes), device=device)


class HostRegistration:
    """``cudaHostRegister`` of a host range (page-locks it and maps it for the GPU); undone by :meth:`close`."""

    PORTABLE, MAPPED = 0x01, 0x02

    def __init__(self, address: int, nbytes: int, device: torch.device | str):
        self.address, self.nbytes, self.device = address, nbytes, torch.device(device)
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.device):
            error = cudart.cudaHostRegister(address, nbytes, self.PORTABLE | self.MAPPED)
        code = int(getattr(error, "value", error))
        if code != 0:
            raise RuntimeError(
                f"cudaHostRegister of {nbytes:,} bytes at {address:#x} failed with CUDA error {code} ({error}); "
                "the host placement needs page-lockable memory (check `ulimit -l` and free RAM)"
            )
        self._registered = True

    def close(self) -> None:
        if self._registered:
            self._registered = False
            with torch.cuda.device(self.device):
                torch.cuda.cudart().cudaHostUnregister(self.address)


# ------------------------------------------------------------------------------------------ fetchers
class EngramFetcher:
    """Dequantised Engram rows for row ids, from tables that one placement holds.

    ``tables`` maps a layer id to ``(weight [rows, 256] uint8, scale [rows, 8] uint8)`` in memory
    the fetch path can read (device memory, or host memory a CUDA tensor aliases, or CPU memory on
    CPU). ``dedup`` (implies ``sort``) and ``sort`` control the plan, used for fetches of at least
    ``dedup_min_ids`` ids (default 65,536 on CUDA, every fetch on CPU); ``max_programs``,
    ``block_rows`` and ``num_warps`` tune the Triton gather, ``prefetch_programs`` caps the programs
    of gathers issued by :meth:`start` so the overlapped compute keeps most SMs.
    """

    placement = "device"

    def __init__(
        self,
        tables: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
        *,
        device: torch.device | str,
        out_dtype: torch.dtype = torch.bfloat16,
        dedup: bool = True,
        sort: bool = True,
        max_programs: int | None = None,
        prefetch_programs: int | None = None,
        block_rows: int = DEFAULT_BLOCK_ROWS,
        num_warps: int = DEFAULT_NUM_WARPS,
        use_kernel: bool | None = None,
        dedup_min_ids: int | None = None,
    ):
        if not tables:
            raise ValueError("an Engram fetcher needs at least one table")
        self.tables = dict(tables)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.out_dtype = out_dtype
        self.dedup, self.sort = dedup, sort or dedup
        self.max_programs, self.prefetch_programs = max_programs, prefetch_programs
        self.block_rows, self.num_warps = block_rows, num_warps
        on_cuda = self.device.type == "cuda"
        self.use_kernel = (on_cuda and triton_available()) if use_kernel is None else use_kernel
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
        planned = row_ids.numel() >= self.dedup_min_ids
        plan = plan_fetch(row_ids.reshape(-1), dedup=self.dedup and planned, sort=self.sort and planned)
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
        if self._stream is None:
            for layer_id in sorted(row_ids_per_layer):
                self._pending[layer_id] = (self.fetch(row_ids_per_layer[layer_id], layer_id), None)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for layer_id in sorted(row_ids_per_layer):
                row_ids = row_ids_per_layer[layer_id]
                if row_ids.device == self.device:
                    row_ids.record_stream(self._stream)
                rows = self.fetch(row_ids, layer_id, programs=self.prefetch_programs)
                done = torch.cuda.Event()
                done.record(self._stream)
                self._pending[layer_id] = (rows, done)

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

    def close(self) -> None:
        """Drop pending prefetches and the tables' references."""
        self._pending.clear()

    # ------------------------------------------------------------------ internals
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
            return gather_dequantize(
                weight,
                scale,
                ids,
                count=count,
                out_dtype=self.out_dtype,
                block_rows=self.block_rows,
                num_warps=self.num_warps,
                max_programs=programs,
            )
        return gather_dequantize_reference(weight, scale, ids[: int(count)], self.out_dtype)


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
        zero_copy_share: float = DEFAULT_ZERO_COPY_SHARE,
        split_min_ids: int = DEFAULT_SPLIT_MIN_IDS,
        staging_threads: int | None = None,
        staging_chunk_rows: int = DEFAULT_CHUNK_ROWS,
        staging_rows: int = DEFAULT_STAGING_ROWS,
        staging_buffers: int = DEFAULT_STAGING_BUFFERS,
        **options: Any,
    ):
        if torch.device(options["device"]).type == "cuda":
            for key, value in HOST_GATHER_SHAPE.items():
                options.setdefault(key, value)
        super().__init__(tables, **options)
        self.store = store
        self.registration = registration
        self.method = resolve_host_method(method)
        self.host_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._share_parts = 0
        self.split_min_ids = split_min_ids
        self._stager: StagedGather | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._split_stream: torch.cuda.Stream | None = None
        if self.method == "zero_copy":
            return
        if self.method == "split":
            if not 0.0 <= zero_copy_share <= 1.0:
                raise ValueError(f"zero_copy_share must lie in [0, 1], got {zero_copy_share}")
            self._share_parts = round(zero_copy_share * (1 << SHARE_BITS))
            if self.device.type == "cuda":
                if not self.use_kernel:
                    raise ValueError("the split host method needs the Triton gather kernel on CUDA")
                self._split_stream = torch.cuda.Stream(self.device)
        self.host_tables = dict(self.tables if host_tables is None else host_tables)
        self._check_host_tables()
        weight, scale = next(iter(self.host_tables.values()))
        self._stager = StagedGather(
            self.device,
            threads=staging_threads,
            chunk_rows=staging_chunk_rows,
            staging_rows=staging_rows,
            buffers=staging_buffers,
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

    def start(self, row_ids_per_layer: Mapping[int, torch.Tensor]) -> None:
        if self.method == "zero_copy":
            return super().start(row_ids_per_layer)
        for layer_id in row_ids_per_layer:
            self._table(layer_id)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream) if self._stream is not None else _no_stream():
            for layer_id in sorted(row_ids_per_layer):
                row_ids = row_ids_per_layer[layer_id]
                if self._stream is not None and row_ids.device == self.device:
                    row_ids.record_stream(self._stream)
                if self._reads_zero_copy(row_ids.numel()):
                    rows = self.fetch(row_ids, layer_id, programs=self.prefetch_programs)
                    done = None
                    if self._stream is not None:
                        done = torch.cuda.Event()
                        done.record(self._stream)
                    self._pending[layer_id] = (rows, done)
                    continue
                row_ids = self._check_ids(row_ids, layer_id)
                plan = self._plan(row_ids)
                share = self._begin_zero_copy_share(layer_id, plan, self.prefetch_programs)
                ids, count, ready = plan.ids, plan.count, None
                if self._stream is not None:  # the ids go to the host on the side stream; the worker waits for them
                    ids = torch.empty(plan.ids.shape, dtype=torch.int64, pin_memory=True)
                    count = torch.empty(1, dtype=torch.int64, pin_memory=True)
                    ids.copy_(plan.ids, non_blocking=True)
                    count.copy_(plan.count, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record(self._stream)
                shape = tuple(row_ids.shape)
                self._pending[layer_id] = self._worker.submit(
                    self._prefetch, layer_id, plan, share, ids, count, ready, shape
                )

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

    def _plan(self, row_ids: torch.Tensor) -> FetchPlan:
        planned = row_ids.numel() >= self.dedup_min_ids
        return plan_fetch(row_ids.reshape(-1), dedup=self.dedup and planned, sort=self.sort and planned)

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
            gather_dequantize(
                weight,
                scale,
                plan.ids,
                count=shared,
                out=rows,
                out_dtype=self.out_dtype,
                block_rows=self.block_rows,
                num_warps=self.num_warps,
                max_programs=programs,
            )
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
        with torch.cuda.stream(self._stream) if self._stream is not None else _no_stream():
            if ready is not None:
                ready.synchronize()  # the plan's ids and count are on the host
            count = int(count)
            rows = self._finish(layer_id, ids, count, share, self._stream)
            rows = rows.index_select(0, plan.inverse) if plan.inverse is not None else rows[:count]
            rows = rows.view(*shape, rows.shape[-1])
            done = None
            if self._stream is not None:
                done = torch.cuda.Event()
                done.record(self._stream)
            return rows, done


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
