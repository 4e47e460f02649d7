"""Gather Engram rows on the CPU and hand them to the GPU as a few large copies (the ``staged`` host fetch).

Why: when the GPU reads scattered rows of host memory itself (zero-copy, :mod:`dsinfer.kernels.engram_gather`),
every row costs an address translation outside the GPU (the host IOMMU's 4 KiB view of guest memory, whatever
page size or CUDA allocation backs the table): on an H200 in a VM, sorted rows of a large table arrive at well
under half the rate of a pinned copy and random ones at about a tenth (docs/perf.md, history, 2026-11-29). The
CPU's own TLBs and page walkers handle scattered reads without that cost, so here CPU threads collect the rows into
pinned staging memory and the GPU receives them through plain host-to-device copies. What bounds this method
instead is the host's memory system: every byte is read from the table, written to staging and read again by the
copy engine. Measured there (``benchmarks/engram_fetch.py --suite staged``; docs/perf.md, history, 2026-11-29,
second round): how fast 16 threads gather random rows depends on the machine, the pipeline below delivers most of
it, and the defaults (16 lanes, 16,384-row chunks) were the best of 4-16 lanes x 4k-32k-row chunks.
:mod:`dsinfer.engram.fetch.host`'s ``split`` method runs this next to the zero-copy kernel, since the two are
bound by different things.

How a gather runs (:meth:`StagedGather.gather`):

* The rows go through staging buffers of ``staging_rows`` rows (pinned on CUDA) in rounds; ``buffers`` of them
  rotate, so one round's copies can still run while the next round is gathered into the next buffer. A buffer
  is reused only after an event recorded behind its last copy has completed.
* Rows stored as records (the store's layout: codes then scales, :mod:`dsinfer.engram.store`) are gathered
  whole, one ``numpy.take`` of 264-byte records per chunk, and copied as records; the outputs are then the
  two column ranges of the device's records. Separate code and scale tables are gathered one after the other.
* Within a round, ``threads`` lanes (one thread each) take chunks of ``chunk_rows`` rows from a shared counter
  and gather them with ``numpy.take`` into the buffer; numpy releases the GIL while it copies, so the lanes run
  in parallel, and a lane that falls behind simply takes fewer chunks. The lanes make no CUDA calls.
* The calling thread issues the copies: each time a lane reports a chunk, it copies the buffer's finished prefix
  once that has grown by ``COPY_CHUNKS`` chunks (and the rest at the end), so the copies overlap the gathering
  and each is large enough to run at full speed.
* Small requests use fewer lanes (chunks of at least ``MIN_CHUNK_ROWS``); a request of one chunk is gathered
  by the calling thread alone.

Everything the GPU does is enqueued on the given stream, so work the caller enqueues there afterwards (the
dequantisation) is ordered after the copies without a host synchronisation. On a CPU device the same code runs
with plain staging memory and synchronous copies; the tests cover the chunking that way.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "DEFAULT_STAGING_BUFFERS",
    "DEFAULT_STAGING_ROWS",
    "MIN_CHUNK_ROWS",
    "StagedGather",
    "default_threads",
]

DEFAULT_CHUNK_ROWS = 16384
"""Rows a lane gathers at a time (4 MB of codes): the best of 4k-32k with 4-16 lanes on the H200 host."""
DEFAULT_STAGING_ROWS = 1 << 18
"""Rows per staging buffer (69 MB pinned); larger requests go through the buffers in rounds."""
DEFAULT_STAGING_BUFFERS = 2
"""Staging buffers in rotation: one being filled while the copies out of the other finish."""
MIN_CHUNK_ROWS = 1024
"""Small requests are cut into chunks of at least this many rows, one lane per chunk."""
COPY_CHUNKS = 4
"""A copy is issued once the gathered prefix has grown by this many chunks."""
DEFAULT_MAX_THREADS = 16
"""More lanes kept helping up to the H200 host's 16 cores; processes sharing a host should divide its cores."""


def default_threads() -> int:
    """Lanes when none are asked for: the CPUs this process may run on, at most ``DEFAULT_MAX_THREADS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - platforms without affinity masks
        cpus = os.cpu_count() or 1
    return max(1, min(DEFAULT_MAX_THREADS, cpus))


class _StagingBuffer:
    """Staging memory for one round (records of codes and scales, pinned on CUDA) and the event behind its last
    copy; ``codes`` and ``scales`` are its two column ranges."""

    def __init__(self, rows: int, row_bytes: int, scale_columns: int, pinned: bool):
        self.records = torch.empty(rows, row_bytes + scale_columns, dtype=torch.uint8, pin_memory=pinned)
        self.codes, self.scales = self.records[:, :row_bytes], self.records[:, row_bytes:]
        self.records_array, self.codes_array, self.scales_array = (
            self.records.numpy(),
            self.codes.numpy(),
            self.scales.numpy(),
        )
        self.copied = torch.cuda.Event() if pinned else None

    @property
    def rows(self) -> int:
        return self.records.shape[0]


@dataclass
class _Round:
    """One round of a gather: ``ids`` (a slice of the request) into ``buffer``, then to ``records`` on the device.

    ``table`` is the host records (``weight`` / ``scale`` None), or None with separate ``weight`` and ``scale``.
    """

    table: np.ndarray | None
    weight: np.ndarray | None
    scale: np.ndarray | None
    ids: np.ndarray
    buffer: _StagingBuffer
    records: torch.Tensor
    chunk: int
    chunks: int
    next_chunk: int = 0
    lock: threading.Lock | None = None
    done: queue.SimpleQueue | None = None

    def take_chunk(self) -> int:
        with self.lock:
            index = self.next_chunk
            self.next_chunk += 1
            return index

    def gather(self, start: int, stop: int) -> None:
        """Rows ``[start, stop)`` of this round into the staging buffer (ids out of the table are clamped)."""
        ids = self.ids[start:stop]
        if self.table is not None:
            np.take(self.table, ids, axis=0, out=self.buffer.records_array[start:stop], mode="clip")
            return
        np.take(self.weight, ids, axis=0, out=self.buffer.codes_array[start:stop], mode="clip")
        np.take(self.scale, ids, axis=0, out=self.buffer.scales_array[start:stop], mode="clip")

    def copy(self, start: int, stop: int) -> None:
        """Rows ``[start, stop)`` of the staging buffer to the output (enqueued on the current stream on CUDA)."""
        self.records[start:stop].copy_(self.buffer.records[start:stop], non_blocking=True)


_FAILED = -1


def _records_of(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """The records ``[rows, row_bytes + scale_columns]`` whose two column ranges are ``weight``, ``scale``, or None."""
    row_bytes, record = weight.shape[1], weight.shape[1] + scale.shape[1]
    if (
        weight.stride() == (record, 1)
        and scale.stride() == (record, 1)
        and weight.shape[0] == scale.shape[0]
        and weight.untyped_storage().data_ptr() == scale.untyped_storage().data_ptr()
        and scale.storage_offset() == weight.storage_offset() + row_bytes
    ):
        return weight.as_strided((weight.shape[0], record), (record, 1))
    return None


class StagedGather:
    """CPU threads gather rows of host tables into staging memory; the caller's thread copies it to ``device``.

    ``threads`` lanes (default :func:`default_threads`) gather chunks of ``chunk_rows`` rows into
    ``buffers`` staging buffers of ``staging_rows`` rows each; tables have rows of ``row_bytes`` codes
    and ``scale_columns`` scale bytes. One gather runs at a time (a lock guards the buffers); call
    :meth:`close` to stop the threads.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        threads: int | None = None,
        chunk_rows: int = DEFAULT_CHUNK_ROWS,
        staging_rows: int = DEFAULT_STAGING_ROWS,
        buffers: int = DEFAULT_STAGING_BUFFERS,
        row_bytes: int = 256,
        scale_columns: int = 8,
    ):
        threads = default_threads() if threads is None else threads
        for name, value in (
            ("threads", threads),
            ("chunk_rows", chunk_rows),
            ("staging_rows", staging_rows),
            ("buffers", buffers),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"staging {name} must be a positive integer, got {value!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"staged gathers copy to a CUDA or CPU device, got {self.device}")
        self.threads, self.chunk_rows, self.buffers = threads, chunk_rows, buffers
        self.staging_rows = max(staging_rows, chunk_rows)
        self.row_bytes, self.scale_columns = row_bytes, scale_columns
        self._on_cuda = self.device.type == "cuda"
        self._staging: list[_StagingBuffer | None] = [None] * buffers
        self._turn = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="engram-staging") if threads > 1 else None

    # ------------------------------------------------------------------ public API
    def chunk_rows_for(self, rows: int) -> int:
        """Rows per chunk for a round of ``rows``: ``chunk_rows``, smaller when fewer chunks than lanes would do."""
        per_lane = -(-rows // self.threads)
        return max(1, min(self.chunk_rows, max(MIN_CHUNK_ROWS, per_lane)))

    def gather(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        ids: torch.Tensor,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes [n, row_bytes], scales [n, scale_columns])``: rows ``ids`` of host tables, on this device.

        ``weight`` and ``scale`` are uint8 CPU tensors with contiguous rows: the two column ranges of one
        table of records (the store's, gathered whole), or two separate tables. The outputs are the two
        column ranges of ``[n, row_bytes + scale_columns]`` records. ``ids`` is a 1-D int64 CPU tensor. Ids
        outside the table are clamped to its first or last row (memory outside it is never read); the
        caller checks them. On CUDA the copies are enqueued on ``stream`` (default: the current stream)
        and may still run when this returns; the outputs are allocated on that stream.
        """
        if weight.device.type != "cpu" or scale.device.type != "cpu":
            raise ValueError("staged gathers read tables in host memory (CPU tensors)")
        if ids.device.type != "cpu" or ids.dim() != 1 or ids.dtype != torch.int64:
            raise ValueError(f"ids must be a 1-D int64 CPU tensor, got {ids.dtype} {tuple(ids.shape)} on {ids.device}")
        if weight.shape[1:] != (self.row_bytes,) or scale.shape[1:] != (self.scale_columns,):
            raise ValueError(
                f"tables must be [rows, {self.row_bytes}] and [rows, {self.scale_columns}], "
                f"got {tuple(weight.shape)} and {tuple(scale.shape)}"
            )
        if self._on_cuda and stream is None:
            stream = torch.cuda.current_stream(self.device)
        rows = ids.numel()
        context = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with context:
            records = torch.empty(rows, self.row_bytes + self.scale_columns, dtype=torch.uint8, device=self.device)
            table = _records_of(weight, scale)
            if table is None and not (weight.is_contiguous() and scale.is_contiguous()):
                raise ValueError(  # numpy.take would first copy the whole table
                    "staged gathers read one table of records or two contiguous tables, got strides "
                    f"{weight.stride()} and {scale.stride()}"
                )
            if table is not None:
                table_array, weight_array, scale_array = table.numpy(), None, None
            else:
                table_array, weight_array, scale_array = None, weight.numpy(), scale.numpy()
            id_array = ids.contiguous().numpy()
            with self._lock:
                for start in range(0, rows, self.staging_rows):
                    stop = min(start + self.staging_rows, rows)
                    buffer = self._next_buffer(stop - start)
                    chunk = self.chunk_rows_for(stop - start)
                    job = _Round(
                        table_array,
                        weight_array,
                        scale_array,
                        id_array[start:stop],
                        buffer,
                        records[start:stop],
                        chunk,
                        -(-(stop - start) // chunk),
                    )
                    self._run_round(job)
                    if buffer.copied is not None:
                        buffer.copied.record(stream)
        return records[:, : self.row_bytes], records[:, self.row_bytes :]

    def close(self) -> None:
        """Stop the lanes (after the gather in progress, if any) and drop the staging memory."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            for buffer in self._staging:
                if buffer is not None and buffer.copied is not None:
                    buffer.copied.synchronize()
            self._staging = [None] * self.buffers

    # ------------------------------------------------------------------ internals
    def _next_buffer(self, rows: int) -> _StagingBuffer:
        """The next staging buffer in rotation, once its last copy is done; grown to ``rows`` if smaller.

        Buffers are made on first use and only grow (up to ``staging_rows``): pinning memory is slow, and
        small requests need no full-size buffers.
        """
        slot = self._turn % self.buffers
        self._turn += 1
        buffer = self._staging[slot]
        if buffer is not None and buffer.copied is not None:
            buffer.copied.synchronize()  # the copy engine has read everything out of it
        if buffer is None or buffer.rows < rows:
            buffer = self._staging[slot] = _StagingBuffer(rows, self.row_bytes, self.scale_columns, self._on_cuda)
        return buffer

    def _run_round(self, job: _Round) -> None:
        """Lanes gather the round's chunks; this thread copies the finished prefix as it grows."""
        rows = job.ids.shape[0]
        lanes = min(self.threads, job.chunks)
        if lanes == 1:
            job.gather(0, rows)
            job.copy(0, rows)
            return
        job.lock, job.done = threading.Lock(), queue.SimpleQueue()
        futures = [self._pool.submit(self._run_lane, job) for _ in range(lanes)]
        finished = [False] * job.chunks
        prefix = copied = 0  # chunks gathered without a gap from the start; chunks copied
        try:
            for _ in range(job.chunks):
                index = job.done.get()
                if index == _FAILED:
                    break
                finished[index] = True
                while prefix < job.chunks and finished[prefix]:
                    prefix += 1
                if prefix - copied >= COPY_CHUNKS or (prefix == job.chunks and copied < prefix):
                    job.copy(copied * job.chunk, min(prefix * job.chunk, rows))
                    copied = prefix
        finally:
            wait(futures)
        for future in futures:
            future.result()  # a lane's error, after every lane has stopped

    @staticmethod
    def _run_lane(job: _Round) -> None:
        """Gather chunks until none is left, reporting each one; a failure is reported before it is raised."""
        try:
            while (index := job.take_chunk()) < job.chunks:
                start = index * job.chunk
                job.gather(start, min(start + job.chunk, job.ids.shape[0]))
                job.done.put(index)
        except BaseException:
            job.done.put(_FAILED)
            raise
