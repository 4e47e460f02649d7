"""Engram tables in one POSIX shared-memory segment per host, mapped by every local rank.

DeepSeek-V4.1 has two Engram tables (layers 1 and 14) of 384,006,168 and 384,016,682 rows. A row is
256 FP8 e4m3 bytes plus 8 ue8m0 scale bytes (one power-of-two scale per 32 channels: the Hugging Face
reference's ``DeepseekV41EngramEmbedding.scale`` is ``[num_embeddings, head_dim // 32]``), stored as
two checkpoint tensors ``layers.L.engram.embed.weight`` (F8_E4M3 ``[rows, 256]``) and
``layers.L.engram.embed.scale`` (F8_E8M0 ``[rows, 8]``). Together about 203 GB: one copy per host,
not one per rank.

**Segment layout.** One file, ``/dev/shm/<name>`` (4 KiB pages) or ``<hugetlbfs mount>/<name>``
(2 MiB pages). A 4 KiB header (magic, state, loader pid, attach count, the table directory) is
followed by each table as one region of *records*, each region aligned to 2 MiB: a record is a row's
256 FP8 codes followed by its 8 scale bytes (264 bytes), so reading a row touches one stretch of
memory. The GPU reads rows of host memory at a rate set by address translations (one per page a read
touches, ``benchmarks/engram_translation_probe.py``): with the scales in a table of their own every
row cost two, and the gather kernel read 65,536 sorted rows of a 64 GiB table at 7.1 GB/s; as records,
at 9.4 GB/s (1.33x; 1.09x at 524,288 rows; docs/perf.md).
:meth:`EngramStore.weight` and :meth:`EngramStore.scale` are the two column ranges of the records.
On Linux ``shm_open(3)`` is an ``open(2)`` under ``/dev/shm``; opening the path directly lets the
same code serve hugetlbfs, and keeps Python's ``resource_tracker`` (which unlinks segments that
*attaching* processes merely opened) out of the way.

**Who loads.** The lowest local rank creates the segment (``O_EXCL``), checks memory, reserves it
with ``posix_fallocate`` (so running out of memory is an error now, not a SIGBUS later), fills it
and sets the header state to ready. The other ranks poll for the file and the ready state, with a
timeout, and fail at once with the loader's message if it reports failure or dies.

**Cleanup: no leaked names.** A tmpfs/hugetlbfs file lives until its name is unlinked *and* the
last mapping and descriptor are gone; mappings vanish with their process however it ends, so only
the *name* can leak. Every path removes it:

1. *Early unlink.* The rank whose attach completes the expected count (the loader itself when it
   is alone) unlinks the name right away. From then on nothing can leak: the kernel frees the
   memory when the last rank unmaps or dies, SIGKILL included.
2. *Loader exits before that* (normal exit, exception): :meth:`EngramStore.close`, called by the
   context manager and by an ``atexit`` hook, unlinks the name; a failed load does so before
   re-raising, after writing its error into the header for the waiting ranks.
3. *Loader dies without running Python code* (SIGKILL, OOM killer, segfault): a reaper process,
   started next to the segment before any byte is loaded, holds the read end of a pipe whose
   write end only the loader has. The kernel closes that end when the loader dies; the reaper
   sees end-of-file and unlinks the name (only if it still names the same inode). It also exits
   on its own once the name is gone. It runs ``python -I -S`` on a few lines of stdlib code, in its
   own session so a signal to the job's process group does not take it along.
4. *An attaching rank dies* before attaching: the count never completes, the name stays until the
   loader exits (2 or 3). After attaching: nothing to do (1).

What is *not* covered: the loader and the reaper both killed before the early unlink (say
``kill -9`` of every process of the user), or processes forked from the loader that keep the pipe
open. :func:`remove_stale_segments` (``python -c "from dsinfer.engram.store import
remove_stale_segments; remove_stale_segments()"``) removes segments whose loader is dead, and a
loader replaces a same-named segment whose loader is dead.

**Huge pages.** ``huge_pages=True`` puts the segment on a hugetlbfs mount (``DSINFER_HUGETLBFS``,
or the first ``hugetlbfs`` in ``/proc/mounts``) when enough free 2 MiB pages exist; otherwise it
logs why and falls back to 4 KiB pages in ``/dev/shm`` (:attr:`EngramStore.huge_pages_fallback`
holds the reason). Huge pages cut the host page-table entries behind a 200 GB table 512-fold and
make loading faster (3.3 against 1.5 GB/s for a 16 GiB table); on the H200 VM of
``benchmarks/engram_fetch.py`` they did not speed up the GPU's scattered reads, whose translation
happens outside the guest (the host IOMMU; memory from ``cuMemCreate`` at 2 MiB granularity reads
alike). Not measured on bare metal. The CPU's own scattered reads (the ``staged`` host method) ran
at 13-18 GB/s with either page size (docs/perf.md).

This module imports only the standard library at import time (torch only inside the methods that
hand out tensors), so helper processes start in milliseconds.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import logging
import mmap
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = [
    "ENGRAM_ROW_BYTES",
    "ENGRAM_SCALE_BLOCK",
    "EngramMemoryError",
    "EngramSource",
    "EngramStore",
    "EngramStoreError",
    "EngramTableLayout",
    "EngramTableSpec",
    "RandomEngramSource",
    "SafetensorsEngramSource",
    "available_shared_memory",
    "default_segment_name",
    "remove_stale_segments",
]

logger = logging.getLogger(__name__)

ENGRAM_ROW_BYTES = 256
"""FP8 bytes per Engram row (``engram_head_dim``)."""

ENGRAM_SCALE_BLOCK = 32
"""Channels sharing one ue8m0 scale: a row has ``256 / 32 = 8`` scale bytes."""

SHM_DIR = Path("/dev/shm")
HUGE_PAGE_BYTES = 2 << 20
SMALL_PAGE_BYTES = 4096
REGION_ALIGNMENT = 2 << 20  # every table region starts on a 2 MiB boundary, whatever the page size
HEADER_BYTES = 4096

HUGETLBFS_ENV = "DSINFER_HUGETLBFS"
ATTACH_TIMEOUT_ENV = "DSINFER_ENGRAM_ATTACH_TIMEOUT"
DEFAULT_ATTACH_TIMEOUT_S = 1800.0

_MAGIC = b"DSENGRM1"
_VERSION = 2  # 2: one region of records per table (1: separate code and scale regions)
_STATE_LOADING, _STATE_READY, _STATE_FAILED = 0, 1, 2
_STATE_NAMES = {_STATE_LOADING: "loading", _STATE_READY: "ready", _STATE_FAILED: "failed"}
# magic, version, state, loader pid, expected attachers, attached, table count, unlinked flag,
# page size, total bytes, data bytes, loaded bytes, loader start time (clock ticks since boot).
_HEADER = struct.Struct("<8sIIIIIIIIQQQQ")
_ERROR_OFFSET, _ERROR_BYTES = 128, 512
_TABLE = struct.Struct("<qQIIQQ")  # layer id, rows, row bytes, scale columns, records offset, record bytes
_TABLES_OFFSET = _ERROR_OFFSET + _ERROR_BYTES
_MAX_TABLES = (HEADER_BYTES - _TABLES_OFFSET) // _TABLE.size
_POLL_S = 0.01


class EngramStoreError(RuntimeError):
    """The Engram segment could not be created, loaded or attached; the message says why."""


class EngramMemoryError(EngramStoreError):
    """The host has too little free shared memory for the Engram tables (checked before loading)."""


# ------------------------------------------------------------------------------------------ layout
@dataclass(frozen=True)
class EngramTableSpec:
    """One layer's table: ``rows`` rows of ``row_bytes`` FP8 codes and ``scale_columns`` ue8m0 bytes."""

    layer_id: int
    rows: int
    row_bytes: int = ENGRAM_ROW_BYTES
    scale_columns: int = ENGRAM_ROW_BYTES // ENGRAM_SCALE_BLOCK

    def __post_init__(self) -> None:
        if self.rows <= 0:
            raise ValueError(f"Engram table of layer {self.layer_id} must have at least one row, got {self.rows}")
        if self.row_bytes <= 0 or self.scale_columns <= 0 or self.row_bytes % self.scale_columns:
            raise ValueError(
                f"Engram table of layer {self.layer_id}: row_bytes {self.row_bytes} must be a positive multiple "
                f"of scale_columns {self.scale_columns}"
            )

    @property
    def record_bytes(self) -> int:
        """Bytes of one row as stored: its codes, then its scales."""
        return self.row_bytes + self.scale_columns

    @property
    def table_bytes(self) -> int:
        return self.rows * self.record_bytes


@dataclass(frozen=True)
class EngramTableLayout(EngramTableSpec):
    """A table spec plus where its records start in the segment."""

    offset: int = 0


def _align(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _layout(specs: Sequence[EngramTableSpec], page_size: int) -> tuple[list[EngramTableLayout], int]:
    """Place the header and every table region; returns the layouts and the segment size."""
    if not specs:
        raise ValueError("an Engram store needs at least one table")
    if len(specs) > _MAX_TABLES:
        raise ValueError(f"an Engram segment holds at most {_MAX_TABLES} tables, got {len(specs)}")
    layer_ids = [spec.layer_id for spec in specs]
    if len(set(layer_ids)) != len(layer_ids):
        raise ValueError(f"Engram tables must have distinct layer ids, got {layer_ids}")
    offset = REGION_ALIGNMENT
    layouts = []
    for spec in specs:
        layouts.append(EngramTableLayout(spec.layer_id, spec.rows, spec.row_bytes, spec.scale_columns, offset))
        offset = _align(offset + spec.table_bytes, REGION_ALIGNMENT)
    return layouts, _align(offset, page_size)


def table_records(segment: torch.Tensor, table: EngramTableLayout) -> torch.Tensor:
    """``[rows, record_bytes]`` view of one table's records in ``segment`` (a uint8 tensor of the whole segment)."""
    return segment[table.offset : table.offset + table.table_bytes].view(table.rows, table.record_bytes)


def segment_bytes(specs: Sequence[EngramTableSpec]) -> int:
    """Bytes of shared memory a segment holding ``specs`` takes (header and 2 MiB alignment included)."""
    return _layout(specs, HUGE_PAGE_BYTES)[1]


# ------------------------------------------------------------------------------------------ sources
class EngramSource(Protocol):
    """Where a loader gets table bytes from: a checkpoint, or random tables for tests and benchmarks."""

    def table_specs(self) -> list[EngramTableSpec]:
        """The tables, in the order they are laid out."""
        ...

    def fill(self, spec: EngramTableSpec, records: memoryview, progress: Callable[[int], None]):
        """Write the table as ``[rows, record_bytes]`` records into ``records`` (each row's codes, then its
        ue8m0 scale bytes); call ``progress(n)`` after each ``n`` bytes written, from any thread."""
        ...


_SAFETENSORS_DTYPES = {"weight": ("F8_E4M3", "U8", "I8"), "scale": ("F8_E8M0", "U8")}


def _read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset where its data starts."""
    try:
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise EngramStoreError(f"{path}: too short to be a safetensors file")
            (length,) = struct.unpack("<Q", prefix)
            if length > 100 << 20:
                raise EngramStoreError(f"{path}: safetensors header of {length} bytes is implausible")
            header = json.loads(handle.read(length))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngramStoreError(f"{path}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise EngramStoreError(f"{path}: the safetensors header is not a JSON object")
    return header, 8 + length


@dataclass(frozen=True)
class _TensorExtent:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int


class SafetensorsEngramSource:
    """Engram tables from checkpoint shards: ``[model.]layers.L.engram.embed.{weight,scale}``.

    Reads only the headers to plan (no tensor is materialised), then copies each tensor's bytes
    straight into the mapped segment with ``os.preadv`` from several threads. The safetensors
    format is a length-prefixed JSON header followed by raw little-endian bytes; reading it here
    keeps the loader free of torch and of a second copy of a 100 GB tensor.
    """

    def __init__(self, files: Iterable[str | os.PathLike[str]], layer_ids: Sequence[int], *, threads: int = 8):
        self.files = [Path(f) for f in files]
        if not self.files:
            raise EngramStoreError("no safetensors files given for the Engram tables")
        self.layer_ids = [int(layer) for layer in layer_ids]
        self.threads = max(1, threads)
        self._extents = self._locate()
        self._specs = [self._spec(layer) for layer in self.layer_ids]

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike[str], layer_ids: Sequence[int], **kwargs: Any):
        """All ``*.safetensors`` shards of a checkpoint directory (the index file lists them, if present)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise EngramStoreError(f"{directory}: not a directory")
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise EngramStoreError(f"{index}: not a valid safetensors index ({exc})") from None
            files = [directory / name for name in names]
        else:
            files = sorted(directory.glob("*.safetensors"))
        return cls(files, layer_ids, **kwargs)

    def _locate(self) -> dict[str, _TensorExtent]:
        wanted = {}
        for layer in self.layer_ids:
            for kind in ("weight", "scale"):
                wanted[f"layers.{layer}.engram.embed.{kind}"] = None
        found: dict[str, _TensorExtent] = {}
        for path in self.files:
            if not path.is_file():
                raise EngramStoreError(f"{path}: safetensors shard not found")
            header, data_start = _read_safetensors_header(path)
            size = path.stat().st_size
            for raw_name, entry in header.items():
                name = raw_name.removeprefix("model.")
                if name not in wanted:
                    continue
                try:
                    begin, end = (int(x) for x in entry["data_offsets"])
                    dtype, shape = str(entry["dtype"]), tuple(int(d) for d in entry["shape"])
                except (KeyError, TypeError, ValueError):
                    raise EngramStoreError(f"{path}: malformed header entry for {raw_name}") from None
                if data_start + end > size or begin > end:
                    raise EngramStoreError(
                        f"{path}: tensor {raw_name} ends at byte {data_start + end} but the file has {size} bytes "
                        "(truncated shard?)"
                    )
                found[name] = _TensorExtent(path, dtype, shape, data_start + begin, end - begin)
        missing = [name for name in wanted if name not in found]
        if missing:
            raise EngramStoreError(
                f"Engram tensors {missing} not found in {len(self.files)} safetensors file(s) "
                f"({', '.join(str(p) for p in self.files[:3])}{', ...' if len(self.files) > 3 else ''})"
            )
        return found

    def _spec(self, layer: int) -> EngramTableSpec:
        weight = self._extents[f"layers.{layer}.engram.embed.weight"]
        scale = self._extents[f"layers.{layer}.engram.embed.scale"]
        for kind, extent in (("weight", weight), ("scale", scale)):
            if extent.dtype not in _SAFETENSORS_DTYPES[kind]:
                raise EngramStoreError(
                    f"{extent.path}: layers.{layer}.engram.embed.{kind} has dtype {extent.dtype}, expected one of "
                    f"{_SAFETENSORS_DTYPES[kind]}"
                )
            if len(extent.shape) != 2 or extent.nbytes != extent.shape[0] * extent.shape[1]:
                raise EngramStoreError(
                    f"{extent.path}: layers.{layer}.engram.embed.{kind} has shape {list(extent.shape)} and "
                    f"{extent.nbytes} bytes; expected a 2-D table of one byte per element"
                )
        rows, row_bytes = weight.shape
        if row_bytes <= 0 or row_bytes % ENGRAM_SCALE_BLOCK:  # the release has 256; tiny test models fewer
            raise EngramStoreError(
                f"{weight.path}: layers.{layer}.engram.embed.weight has {row_bytes} columns, expected a positive "
                f"multiple of {ENGRAM_SCALE_BLOCK} ({ENGRAM_ROW_BYTES} in the release)"
            )
        expected_scale = (rows, row_bytes // ENGRAM_SCALE_BLOCK)
        if scale.shape != expected_scale:
            raise EngramStoreError(
                f"{scale.path}: layers.{layer}.engram.embed.scale has shape {list(scale.shape)}, expected "
                f"{list(expected_scale)} (one ue8m0 scale per {ENGRAM_SCALE_BLOCK} channels of each row)"
            )
        return EngramTableSpec(layer, rows, row_bytes, expected_scale[1])

    def table_specs(self) -> list[EngramTableSpec]:
        return list(self._specs)

    def fill(self, spec: EngramTableSpec, records: memoryview, progress: Callable[[int], None]):
        """Read the two tensors a chunk of rows at a time (threads in parallel) and interleave them into records."""
        import numpy as np

        table = np.frombuffer(records, dtype=np.uint8).reshape(spec.rows, spec.record_bytes)
        chunk_rows = max(1, (64 << 20) // spec.row_bytes)

        def load(start: int) -> None:
            stop = min(start + chunk_rows, spec.rows)
            weight = bytearray((stop - start) * spec.row_bytes)
            scale = bytearray((stop - start) * spec.scale_columns)
            for path, file_offset, target in self._row_reads(spec.layer_id, start, stop, weight, scale, len(weight)):
                _read_exactly(path, file_offset, target)
            table[start:stop, : spec.row_bytes] = np.frombuffer(weight, dtype=np.uint8).reshape(-1, spec.row_bytes)
            table[start:stop, spec.row_bytes :] = np.frombuffer(scale, dtype=np.uint8).reshape(-1, spec.scale_columns)
            progress((stop - start) * spec.record_bytes)

        try:
            with ThreadPoolExecutor(max_workers=self.threads) as pool:
                for _ in pool.map(load, range(0, spec.rows, chunk_rows)):
                    pass
        finally:
            table = None  # drop the export of ``records`` before the caller releases it

    def read_rows(self, layer_id: int, start: int, stop: int) -> tuple[bytearray, bytearray]:
        """The raw bytes of rows ``[start, stop)`` of ``layer_id``'s table: (FP8 codes, ue8m0 scales).

        Rows are contiguous in the shard, so this reads just that byte range of each tensor (the
        ``sharded`` placement loads a rank's slice this way, never the whole table).
        """
        spec = self._specs[self.layer_ids.index(layer_id)]
        if not 0 <= start <= stop <= spec.rows:
            raise EngramStoreError(f"rows [{start}, {stop}) lie outside layer {layer_id}'s table of {spec.rows} rows")
        weight = bytearray((stop - start) * spec.row_bytes)
        scale = bytearray((stop - start) * spec.scale_columns)
        jobs = self._row_reads(layer_id, start, stop, weight, scale, 64 << 20)
        with ThreadPoolExecutor(max_workers=self.threads) as pool:
            for _ in pool.map(lambda job: _read_exactly(*job), jobs):
                pass
        return weight, scale

    def _row_reads(
        self, layer_id: int, start: int, stop: int, weight: bytearray, scale: bytearray, chunk: int
    ) -> list[tuple[Path, int, memoryview]]:
        """``(file, offset, target)`` reads of at most ``chunk`` bytes that put rows ``[start, stop)`` of the
        layer's weight and scale tensors into ``weight`` / ``scale``."""
        jobs = []
        for kind, target in (("weight", memoryview(weight)), ("scale", memoryview(scale))):
            extent = self._extents[f"layers.{layer_id}.engram.embed.{kind}"]
            row_bytes = extent.shape[1]
            first, nbytes = extent.start + start * row_bytes, (stop - start) * row_bytes
            for offset in range(0, nbytes, chunk):
                jobs.append((extent.path, first + offset, target[offset : min(offset + chunk, nbytes)]))
        return jobs


def _read_exactly(path: Path, file_offset: int, target: memoryview) -> None:
    """Fill ``target`` with the bytes of ``path`` from ``file_offset`` on (an error at a short file)."""
    size = len(target)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < size:
            n = os.preadv(fd, [target[done:]], file_offset + done)
            if n == 0:
                raise EngramStoreError(f"{path}: unexpected end of file at byte {file_offset + done}")
            done += n
    finally:
        os.close(fd)
        target.release()


class RandomEngramSource:
    """Deterministic random tables (``numpy`` PCG64): FP8 codes without NaN, scales in a sane range.

    For tests and benchmarks. ``tile_rows`` repeats one random block of that many rows over the
    table, which fills a 64 GiB benchmark table at memory speed; tests leave it ``None`` so every
    row differs. :meth:`expected` returns the same bytes as numpy arrays.
    """

    def __init__(
        self,
        rows: Mapping[int, int],
        *,
        seed: int = 0,
        tile_rows: int | None = None,
        scale_exponents: tuple[int, int] = (112, 135),
    ):
        self.rows = {int(layer): int(n) for layer, n in rows.items()}
        self.seed = seed
        self.tile_rows = tile_rows
        self.scale_exponents = scale_exponents
        self._chunk_rows = tile_rows or (1 << 16)

    def table_specs(self) -> list[EngramTableSpec]:
        return [EngramTableSpec(layer, rows) for layer, rows in self.rows.items()]

    def _block(self, layer: int, block: int, rows: int):
        import numpy as np

        rng = np.random.default_rng((self.seed, layer, block))
        codes = rng.integers(0, 256, size=(rows, ENGRAM_ROW_BYTES), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] ^= 1  # 0x7f / 0xff are NaN in e4m3fn: step to the neighbouring code
        low, high = self.scale_exponents
        scales = rng.integers(low, high + 1, size=(rows, ENGRAM_ROW_BYTES // ENGRAM_SCALE_BLOCK), dtype=np.uint8)
        return codes, scales

    def fill(self, spec: EngramTableSpec, records: memoryview, progress: Callable[[int], None]):
        import numpy as np

        table = np.frombuffer(records, dtype=np.uint8).reshape(spec.rows, spec.record_bytes)
        weight_rows, scale_rows = table[:, : spec.row_bytes], table[:, spec.row_bytes :]
        tile = self._block(spec.layer_id, 0, self._chunk_rows) if self.tile_rows else None
        for block, start in enumerate(range(0, spec.rows, self._chunk_rows)):
            stop = min(start + self._chunk_rows, spec.rows)
            codes, scales = tile if tile is not None else self._block(spec.layer_id, block, self._chunk_rows)
            weight_rows[start:stop] = codes[: stop - start]
            scale_rows[start:stop] = scales[: stop - start]
            progress((stop - start) * spec.record_bytes)
        del table, weight_rows, scale_rows

    def expected(self, layer: int):
        """``(codes [rows, 256], scales [rows, 8])`` uint8 numpy arrays of one table."""
        import numpy as np

        spec = next(s for s in self.table_specs() if s.layer_id == layer)
        records = np.empty((spec.rows, spec.record_bytes), dtype=np.uint8)
        self.fill(spec, memoryview(records).cast("B"), lambda n: None)
        return records[:, : spec.row_bytes].copy(), records[:, spec.row_bytes :].copy()


# ------------------------------------------------------------------------------------------ memory
def _meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (huge-page counts stay counts)."""
    values = {}
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    values[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return values


def available_shared_memory(directory: Path, huge_pages: bool) -> tuple[int, str]:
    """Bytes a new segment in ``directory`` can take, and a description of what limited it.

    4 KiB pages: the smaller of the tmpfs's free space and the kernel's ``MemAvailable``.
    hugetlbfs: free, unreserved huge pages (and the mount's own size limit, if any).
    """
    info = _meminfo()
    stats = os.statvfs(directory)
    fs_free = stats.f_bavail * stats.f_frsize
    if huge_pages:
        page = info.get("Hugepagesize", HUGE_PAGE_BYTES)
        free = (info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0)) * page
        detail = f"{info.get('HugePages_Free', 0)} free huge pages of {page >> 20} MiB"
        if stats.f_blocks:  # a size= limit on the mount
            free = min(free, fs_free)
            detail += f", {fs_free:,} bytes left under the mount's size limit"
        return max(free, 0), detail
    available = info.get("MemAvailable")
    if available is None:
        return fs_free, f"{fs_free:,} bytes free in {directory}"
    return min(fs_free, available), f"{fs_free:,} bytes free in {directory}, MemAvailable {available:,} bytes"


def _check_memory(directory: Path, huge_pages: bool, needed: int) -> None:
    available, detail = available_shared_memory(directory, huge_pages)
    if needed > available:
        raise EngramMemoryError(
            f"the Engram tables need {needed:,} bytes ({needed / 2**30:.2f} GiB) of shared memory but only "
            f"{available:,} bytes ({available / 2**30:.2f} GiB) are available ({detail}); free memory, use a host "
            "with more RAM, or choose the 'sharded' Engram placement"
        )


def _hugetlbfs_mount() -> Path | None:
    """``$DSINFER_HUGETLBFS``, else the first 2 MiB hugetlbfs in ``/proc/mounts``."""
    override = os.environ.get(HUGETLBFS_ENV)
    if override:
        return Path(override)
    try:
        with open("/proc/mounts") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) >= 4 and fields[2] == "hugetlbfs":
                    options = fields[3].split(",")
                    if any(o.startswith("pagesize=") and o not in ("pagesize=2M", "pagesize=2048k") for o in options):
                        continue
                    return Path(fields[1])
    except OSError:
        pass
    return None


def _is_hugetlbfs(directory: Path) -> bool:
    try:
        with open("/proc/mounts") as handle:
            mounts = [line.split() for line in handle]
    except OSError:
        return False
    resolved = str(directory.resolve())
    return any(len(f) >= 3 and f[2] == "hugetlbfs" and f[1] == resolved for f in mounts)


# ------------------------------------------------------------------------------------------ processes
def _process_start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (0 when unknown): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _process_alive(pid: int, start_time: int) -> bool:
    """Whether ``pid`` still runs the process that started at ``start_time`` (zombies count as dead)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rpartition(")")[2].split()
        if fields[0] in ("Z", "X"):
            return False
        return not start_time or int(fields[19]) == start_time
    except (OSError, ValueError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# The reaper: runs `python -I -S -c` this, with the segment path, its device and inode numbers and
# the read end of a pipe whose write end only the loader holds. End of file on the pipe means the
# loader is gone: unlink the name if it is still ours. Exits early once the name is gone.
_REAPER_SOURCE = """
import os, select, sys
path, dev, ino, fd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def ours():
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_dev == dev and st.st_ino == ino
poller = select.poll()
poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
while True:
    if poller.poll(500):
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if not data:
            break
    if not ours():
        sys.exit(0)
if ours():
    try:
        os.unlink(path)
    except OSError:
        pass
"""


def _start_reaper(path: Path, stat: os.stat_result) -> tuple[int, subprocess.Popen]:
    """Start the reaper for ``path``; returns the pipe's write end (keep it open while loaded) and the process."""
    read_fd, write_fd = os.pipe()
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                "-c",
                _REAPER_SOURCE,
                str(path),
                str(stat.st_dev),
                str(stat.st_ino),
                str(read_fd),
            ],
            pass_fds=(read_fd,),
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except BaseException:
        os.close(write_fd)
        raise
    finally:
        os.close(read_fd)
    return write_fd, process


def _unlink_if_same(path: Path, stat: os.stat_result) -> bool:
    """Unlink ``path`` if it still names the inode of ``stat``; True if this call removed it."""
    try:
        current = os.stat(path)
        if (current.st_dev, current.st_ino) != (stat.st_dev, stat.st_ino):
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------------------------------ header
@dataclass
class _Header:
    state: int
    loader_pid: int
    expected_attachers: int
    attached: int
    table_count: int
    unlinked: int
    page_size: int
    total_bytes: int
    data_bytes: int
    loaded_bytes: int
    loader_start_time: int
    error: str
    tables: list[EngramTableLayout]

    @classmethod
    def read(cls, buffer: Any) -> _Header | None:
        """The header in ``buffer``, or None while the magic is not written yet."""
        fields = _HEADER.unpack_from(buffer, 0)
        if fields[0] != _MAGIC:
            return None
        if fields[1] != _VERSION:
            raise EngramStoreError(f"Engram segment has header version {fields[1]}, this code reads {_VERSION}")
        raw_error = bytes(buffer[_ERROR_OFFSET : _ERROR_OFFSET + _ERROR_BYTES]).split(b"\0", 1)[0]
        tables = []
        for index in range(fields[6]):
            layer, rows, row_bytes, scale_columns, offset, record_bytes = _TABLE.unpack_from(
                buffer, _TABLES_OFFSET + index * _TABLE.size
            )
            table = EngramTableLayout(layer, rows, row_bytes, scale_columns, offset)
            if record_bytes != table.record_bytes:
                raise EngramStoreError(
                    f"Engram segment table {layer}: records of {record_bytes} bytes, expected {table.record_bytes}"
                )
            tables.append(table)
        return cls(*fields[2:], raw_error.decode("utf-8", "replace"), tables)

    def write(self, buffer: Any) -> None:
        """Everything but the magic, which :func:`_publish` writes last."""
        for index, table in enumerate(self.tables):
            _TABLE.pack_into(
                buffer,
                _TABLES_OFFSET + index * _TABLE.size,
                table.layer_id,
                table.rows,
                table.row_bytes,
                table.scale_columns,
                table.offset,
                table.record_bytes,
            )
        _HEADER.pack_into(
            buffer,
            0,
            b"\0" * 8,
            _VERSION,
            self.state,
            self.loader_pid,
            self.expected_attachers,
            self.attached,
            self.table_count,
            self.unlinked,
            self.page_size,
            self.total_bytes,
            self.data_bytes,
            self.loaded_bytes,
            self.loader_start_time,
        )
        buffer[0:8] = _MAGIC


# Field offsets inside _HEADER for the few fields updated after creation.
_STATE_AT, _ATTACHED_AT, _UNLINKED_AT, _LOADED_AT = 12, 24, 32, 56


def _put_u32(buffer: Any, offset: int, value: int) -> None:
    struct.pack_into("<I", buffer, offset, value)


class _Lock:
    """``flock`` on the segment file: orders header updates between ranks (and is a memory barrier)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


# ------------------------------------------------------------------------------------------ the store
def default_segment_name(key: str = "") -> str:
    """A segment name every local rank of one job computes alike.

    From ``DSINFER_ENGRAM_SEGMENT`` if set; otherwise from ``key`` (say the checkpoint path) and the
    launcher's rendezvous (``MASTER_ADDR``/``MASTER_PORT``), so two jobs on one host do not collide.
    """
    explicit = os.environ.get("DSINFER_ENGRAM_SEGMENT")
    if explicit:
        return explicit
    import hashlib

    job = f"{key}|{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}|{os.getuid()}"
    return "dsinfer-engram-" + hashlib.sha1(job.encode()).hexdigest()[:16]


def _check_name(name: str) -> None:
    if not name or "/" in name or name in (".", "..") or len(name) > 200:
        raise ValueError(f"invalid Engram segment name {name!r}: a plain file name without '/' is needed")


class EngramStore:
    """The Engram tables of one host, mapped from a shared-memory segment.

    Use :meth:`open` from every local rank (the lowest one loads, the others attach), or
    :meth:`create` / :meth:`attach` directly. :meth:`weight` and :meth:`scale` give uint8 tensors
    that view the shared memory (no copy); :attr:`address` and :attr:`nbytes` describe the whole
    mapping, for ``cudaHostRegister``. Close with :meth:`close` or a ``with`` block.
    """

    def __init__(
        self,
        *,
        path: Path,
        mapping: mmap.mmap,
        header: _Header,
        is_loader: bool,
        stat: os.stat_result,
        huge_pages_fallback: str | None = None,
        reaper: tuple[int, subprocess.Popen] | None = None,
    ):
        self.path = path
        self.name = path.name
        self._mapping = mapping
        self.is_loader = is_loader
        self.page_size = header.page_size
        self.nbytes = header.total_bytes
        self.tables: dict[int, EngramTableLayout] = {table.layer_id: table for table in header.tables}
        self.huge_pages_fallback = huge_pages_fallback
        self._stat = stat
        self._reaper = reaper
        self._tensors: dict[tuple[int, str], torch.Tensor] = {}
        self._base: torch.Tensor | None = None
        self._closed = False
        if is_loader:
            atexit.register(self.close)

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(
        cls,
        name: str,
        source: EngramSource | None,
        *,
        local_rank: int,
        local_world_size: int,
        huge_pages: bool = False,
        timeout: float | None = None,
        check_memory: bool = True,
    ) -> EngramStore:
        """Local rank 0 creates and loads the segment from ``source``; every other local rank attaches."""
        if not 0 <= local_rank < local_world_size:
            raise ValueError(f"local_rank {local_rank} is outside [0, {local_world_size})")
        if local_rank == 0:
            if source is None:
                raise ValueError("local rank 0 loads the Engram tables and needs a source")
            return cls.create(
                name, source, attachers=local_world_size - 1, huge_pages=huge_pages, check_memory=check_memory
            )
        return cls.attach(name, timeout=timeout)

    @classmethod
    def create(
        cls,
        name: str,
        source: EngramSource,
        *,
        attachers: int = 0,
        huge_pages: bool = False,
        check_memory: bool = True,
    ) -> EngramStore:
        """Create segment ``name``, load every table of ``source`` into it, and mark it ready.

        ``attachers`` other processes are expected to :meth:`attach`; the name is unlinked as soon as
        the last of them has (right after loading when there are none).
        """
        _check_name(name)
        if attachers < 0:
            raise ValueError(f"attachers must be non-negative, got {attachers}")
        specs = source.table_specs()
        directory, page_size, fallback = cls._choose_location(specs, huge_pages)
        layouts, total = _layout(specs, page_size)
        if check_memory:
            _check_memory(directory, page_size == HUGE_PAGE_BYTES, total)
        path = directory / name
        fd = cls._create_file(path)
        stat = os.fstat(fd)
        reaper = None
        mapping = None
        try:
            reaper = _start_reaper(path, stat)
            os.ftruncate(fd, total)
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                    raise EngramMemoryError(
                        f"reserving {total:,} bytes for the Engram segment {path} failed: {exc.strerror}"
                    ) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapping = mmap.mmap(fd, total, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            data_bytes = sum(spec.table_bytes for spec in specs)
            header = _Header(
                _STATE_LOADING,
                os.getpid(),
                attachers,
                0,
                len(layouts),
                0,
                page_size,
                total,
                data_bytes,
                0,
                _process_start_time(os.getpid()),
                "",
                layouts,
            )
            header.write(mapping)
            store = cls(
                path=path,
                mapping=mapping,
                header=header,
                is_loader=True,
                stat=stat,
                huge_pages_fallback=fallback,
                reaper=reaper,
            )
        except BaseException:
            if mapping is not None:
                mapping.close()
            _unlink_if_same(path, stat)
            os.close(fd)
            if reaper is not None:
                os.close(reaper[0])
            raise
        try:
            store._load(source, fd)
            with _Lock(fd):
                _put_u32(mapping, _STATE_AT, _STATE_READY)
                if attachers == 0:
                    store._unlink_name(fd)
        except BaseException as exc:
            store._fail(fd, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            os.close(fd)
        return store

    @staticmethod
    def _choose_location(specs: Sequence[EngramTableSpec], huge_pages: bool) -> tuple[Path, int, str | None]:
        """hugetlbfs when asked for and usable, else /dev/shm; the third item says why huge pages were not used."""
        if not huge_pages:
            return SHM_DIR, SMALL_PAGE_BYTES, None
        mount = _hugetlbfs_mount()
        needed = _layout(specs, HUGE_PAGE_BYTES)[1]
        if mount is None:
            reason = "no hugetlbfs is mounted (mount -t hugetlbfs none /dev/hugepages, or set DSINFER_HUGETLBFS)"
        elif not mount.is_dir() or not _is_hugetlbfs(mount):
            reason = f"{mount} is not a mounted hugetlbfs"
        else:
            available, detail = available_shared_memory(mount, huge_pages=True)
            if available >= needed:
                return mount, HUGE_PAGE_BYTES, None
            reason = (
                f"the tables need {needed // HUGE_PAGE_BYTES} huge pages of 2 MiB but {detail} "
                f"(raise vm.nr_hugepages by {-(-(needed - available) // HUGE_PAGE_BYTES)})"
            )
        logger.warning("Engram store: huge pages requested but %s; falling back to 4 KiB pages in %s", reason, SHM_DIR)
        return SHM_DIR, SMALL_PAGE_BYTES, reason

    @staticmethod
    def _create_file(path: Path) -> int:
        """``open(O_CREAT | O_EXCL)``; replaces a same-named segment whose loader is dead."""
        for _ in range(2):
            try:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                owner = _segment_owner(path)
                if owner is None and time.time() - _mtime(path) < 5.0:
                    raise EngramStoreError(
                        f"Engram segment {path} is being created by another process right now: another job uses the "
                        "same segment name (set DSINFER_ENGRAM_SEGMENT to tell them apart)"
                    ) from None
                if owner is not None and owner[1]:
                    raise EngramStoreError(
                        f"Engram segment {path} already exists and its loader (pid {owner[0]}) is alive: another job "
                        "uses the same segment name (set DSINFER_ENGRAM_SEGMENT to tell them apart)"
                    ) from None
                logger.warning("Engram store: removing stale segment %s left by a dead loader", path)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        raise EngramStoreError(f"could not create Engram segment {path}: it keeps reappearing")

    def _load(self, source: EngramSource, fd: int) -> None:
        loaded = 0
        lock = threading.Lock()  # sources report from their reader threads

        def progress(n: int) -> None:
            nonlocal loaded
            with lock:
                loaded += n
                struct.pack_into("<Q", self._mapping, _LOADED_AT, loaded)

        view = memoryview(self._mapping)
        try:
            for table in self.tables.values():
                records = view[table.offset : table.offset + table.table_bytes]
                try:
                    source.fill(table, records, progress)
                finally:
                    records.release()
        finally:
            view.release()

    def _fail(self, fd: int, message: str) -> None:
        """Tell waiting ranks the load failed (the message goes in the header), then drop the name."""
        try:
            encoded = message.encode("utf-8", "replace")[: _ERROR_BYTES - 1]
            with _Lock(fd):
                self._mapping[_ERROR_OFFSET : _ERROR_OFFSET + _ERROR_BYTES] = encoded.ljust(_ERROR_BYTES, b"\0")
                _put_u32(self._mapping, _STATE_AT, _STATE_FAILED)
        finally:
            self.close()

    def _unlink_name(self, fd: int) -> None:
        """Remove the name (caller holds the lock); the memory lives on while anyone maps it."""
        _unlink_if_same(self.path, self._stat)
        _put_u32(self._mapping, _UNLINKED_AT, 1)

    @classmethod
    def attach(cls, name: str, *, timeout: float | None = None) -> EngramStore:
        """Wait (up to ``timeout`` s) for segment ``name`` to be ready, map it, and count this rank in."""
        _check_name(name)
        if timeout is None:
            timeout = float(os.environ.get(ATTACH_TIMEOUT_ENV, DEFAULT_ATTACH_TIMEOUT_S))
        deadline = time.monotonic() + timeout
        candidates = [d / name for d in (_hugetlbfs_mount(), SHM_DIR) if d is not None]
        last_seen: _Header | None = None
        # Once the file is found its descriptor stays open while waiting: the inode then outlives an
        # unlink, so a failed or dead loader's last header is still readable here.
        fd: int | None = None
        try:
            while True:
                if fd is None:
                    fd, path = cls._open_existing(candidates)
                if fd is not None:
                    header = cls._peek(fd)
                    if header is not None:
                        last_seen = header
                        if header.state == _STATE_FAILED:
                            raise EngramStoreError(
                                f"the Engram loader (pid {header.loader_pid}) failed to load {path}: {header.error}"
                            )
                        if header.state == _STATE_READY:
                            return cls._map_ready(path, fd)
                        if not _process_alive(header.loader_pid, header.loader_start_time):
                            raise EngramStoreError(
                                f"the Engram loader (pid {header.loader_pid}) died while loading {path} "
                                f"({header.loaded_bytes:,} of {header.data_bytes:,} bytes loaded); its reaper "
                                "removes the segment"
                            )
                    if os.fstat(fd).st_nlink == 0:  # unlinked while we waited
                        if header is not None:
                            raise EngramStoreError(
                                f"the Engram segment {path} was removed before it was ready: its loader (pid "
                                f"{header.loader_pid}) exited after loading {header.loaded_bytes:,} of "
                                f"{header.data_bytes:,} bytes"
                            )
                        os.close(fd)
                        fd = None
                if time.monotonic() >= deadline:
                    raise cls._timeout_error(name, candidates, timeout, last_seen)
                time.sleep(_POLL_S)
        finally:
            if fd is not None:
                os.close(fd)

    @staticmethod
    def _open_existing(candidates: Sequence[Path]) -> tuple[int | None, Path | None]:
        for path in candidates:
            try:
                return os.open(path, os.O_RDWR), path
            except FileNotFoundError:
                continue
        return None, None

    @staticmethod
    def _peek(fd: int) -> _Header | None:
        if os.fstat(fd).st_size < HEADER_BYTES:
            return None
        with mmap.mmap(fd, HEADER_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as head, _Lock(fd):
            return _Header.read(head)

    @staticmethod
    def _timeout_error(name: str, candidates: Sequence[Path], timeout: float, header: _Header | None) -> Exception:
        where = " or ".join(str(p) for p in candidates)
        if header is None:
            return EngramStoreError(
                f"timed out after {timeout:.0f} s waiting for the Engram segment {where} to appear (is local rank 0 "
                f"loading it under the same name? set {ATTACH_TIMEOUT_ENV} to wait longer)"
            )
        return EngramStoreError(
            f"timed out after {timeout:.0f} s waiting for the Engram segment {where} to become ready: state "
            f"{_STATE_NAMES.get(header.state, header.state)}, loader pid {header.loader_pid}, "
            f"{header.loaded_bytes:,} of {header.data_bytes:,} bytes loaded (set {ATTACH_TIMEOUT_ENV} to wait longer)"
        )

    @classmethod
    def _map_ready(cls, path: Path, fd: int) -> EngramStore:
        size = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        stat = os.fstat(fd)
        with _Lock(fd):
            header = _Header.read(mapping)
            attached = header.attached + 1
            _put_u32(mapping, _ATTACHED_AT, attached)
            store = cls(path=path, mapping=mapping, header=header, is_loader=False, stat=stat)
            if attached >= header.expected_attachers and not header.unlinked:
                store._unlink_name(fd)
        return store

    # ------------------------------------------------------------------ tensors
    @property
    def layer_ids(self) -> list[int]:
        return list(self.tables)

    def _tensor(self, layer_id: int, kind: str) -> torch.Tensor:
        if self._closed:
            raise EngramStoreError(f"Engram store {self.name} is closed")
        key = (layer_id, kind)
        if key not in self._tensors:
            if layer_id not in self.tables:
                raise KeyError(f"no Engram table for layer {layer_id} (tables: {self.layer_ids})")
            table = self.tables[layer_id]
            records = table_records(self.base_tensor(), table)
            self._tensors[key] = {
                "records": records,
                "weight": records[:, : table.row_bytes],
                "scale": records[:, table.row_bytes :],
            }[kind]
        return self._tensors[key]

    def region(self, layer_id: int) -> memoryview:
        """The raw bytes of ``layer_id``'s records (no torch; release when done)."""
        if self._closed:
            raise EngramStoreError(f"Engram store {self.name} is closed")
        if layer_id not in self.tables:
            raise KeyError(f"no Engram table for layer {layer_id} (tables: {self.layer_ids})")
        table = self.tables[layer_id]
        return memoryview(self._mapping)[table.offset : table.offset + table.table_bytes]

    def base_tensor(self) -> torch.Tensor:
        """The whole mapping as one uint8 CPU tensor (no copy)."""
        import torch

        if self._base is None:
            # Through a memoryview: its buffer export lives as long as the tensor, so close() cannot unmap the
            # segment under a tensor still in use (torch.frombuffer on the mmap itself holds no export).
            self._base = torch.frombuffer(memoryview(self._mapping), dtype=torch.uint8, count=self.nbytes)
        return self._base

    def records(self, layer_id: int) -> torch.Tensor:
        """``[rows, 264]`` uint8: ``layer_id``'s table as stored, each row's codes then its scales (shared memory)."""
        return self._tensor(layer_id, "records")

    def weight(self, layer_id: int) -> torch.Tensor:
        """``[rows, 256]`` uint8 with a row stride of 264: the FP8 e4m3 codes of ``layer_id``'s table."""
        return self._tensor(layer_id, "weight")

    def scale(self, layer_id: int) -> torch.Tensor:
        """``[rows, 8]`` uint8 with a row stride of 264: the ue8m0 scale bytes of ``layer_id``'s table."""
        return self._tensor(layer_id, "scale")

    @property
    def address(self) -> int:
        """Virtual address of the mapping in this process (what ``cudaHostRegister`` takes)."""
        return self.base_tensor().data_ptr()

    @property
    def huge_pages(self) -> bool:
        return self.page_size == HUGE_PAGE_BYTES

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Drop this process's view; the loader also removes the name if it is still there. Idempotent.

        The memory itself is freed by the kernel once every process has unmapped it. Tensors from
        :meth:`weight` / :meth:`scale` still alive elsewhere keep this process's mapping until they go.
        """
        if self._closed:
            return
        self._closed = True
        if self.is_loader:
            atexit.unregister(self.close)
            _unlink_if_same(self.path, self._stat)
        self._tensors.clear()
        self._base = None
        try:
            self._mapping.close()
        except BufferError:
            pass  # someone still holds a tensor over it; the mapping goes when they do
        if self._reaper is not None:
            os.close(self._reaper[0])  # the reaper sees end-of-file, finds the name gone, exits
            self._reaper = None

    def __enter__(self) -> EngramStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        tables = ", ".join(f"layer {t.layer_id}: {t.rows:,} rows" for t in self.tables.values())
        return f"EngramStore({self.path}, {self.nbytes:,} bytes, page {self.page_size}, {tables})"


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _segment_owner(path: Path) -> tuple[int, bool] | None:
    """``(loader pid, alive)`` of an existing segment, or None if it has no readable header."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size < HEADER_BYTES:
            return None
        with mmap.mmap(fd, HEADER_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as head:
            header = _Header.read(head)
    except (OSError, EngramStoreError, struct.error):
        return None
    finally:
        os.close(fd)
    if header is None:
        return None
    return header.loader_pid, _process_alive(header.loader_pid, header.loader_start_time)


def remove_stale_segments(directories: Sequence[Path] | None = None) -> list[Path]:
    """Unlink Engram segments whose loader is dead (leftovers of a host-wide ``kill -9``); returns them."""
    if directories is None:
        directories = [d for d in (SHM_DIR, _hugetlbfs_mount()) if d is not None]
    removed = []
    for directory in directories:
        try:
            entries = list(Path(directory).iterdir())
        except OSError:
            continue
        for path in entries:
            owner = _segment_owner(path)
            if owner is not None and not owner[1]:
                try:
                    path.unlink()
                    removed.append(path)
                except OSError:
                    pass
    return removed
