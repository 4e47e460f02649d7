"""The layout of an Engram segment: its header, its table directory and one region of records per table.

**Segment layout.** One file, ``/dev/shm/<name>`` (4 KiB pages) or ``<hugetlbfs mount>/<name>``
(2 MiB pages). A 4 KiB header (magic, state, loader pid, attach count, the table directory) is
followed by each table as one region of *records*, each region aligned to 2 MiB: a record is a row's
256 FP8 codes followed by its 8 scale bytes (264 bytes), so reading a row touches one stretch of
memory. The GPU reads rows of host memory at a rate set by address translations (one per page a read
touches, ``benchmarks/engram_translation_probe.py``): with the scales in a table of their own every
row cost two, and the gather kernel read sorted rows of a 64 GiB table measurably slower than it reads them as
records (docs/perf.md, history, 2026-11-29, third round).
:meth:`~dsinfer.engram.store.EngramStore.weight` and :meth:`~dsinfer.engram.store.EngramStore.scale` are the
two column ranges of the records.
On Linux ``shm_open(3)`` is an ``open(2)`` under ``/dev/shm``; opening the path directly lets the
same code serve hugetlbfs, and keeps Python's ``resource_tracker`` (which unlinks segments that
*attaching* processes merely opened) out of the way.

The loader writes the header; later changes of the state, the attach count and the unlinked flag
happen under :class:`HeaderLock`, as do the reads of a rank that waits for the segment.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsinfer.engram.store.errors import EngramStoreError

if TYPE_CHECKING:
    import torch

__all__ = [
    "ENGRAM_ROW_BYTES",
    "ENGRAM_SCALE_BLOCK",
    "HEADER_BYTES",
    "HUGE_PAGE_BYTES",
    "SMALL_PAGE_BYTES",
    "EngramTableLayout",
    "EngramTableSpec",
    "HeaderLock",
    "SegmentHeader",
    "layout_tables",
    "read_header",
    "segment_bytes",
    "table_records",
]

ENGRAM_ROW_BYTES = 256
"""FP8 bytes per Engram row (``engram_head_dim``)."""

ENGRAM_SCALE_BLOCK = 32
"""Channels sharing one ue8m0 scale: a row has ``256 / 32 = 8`` scale bytes."""

HUGE_PAGE_BYTES = 2 << 20
SMALL_PAGE_BYTES = 4096
REGION_ALIGNMENT = 2 << 20  # every table region starts on a 2 MiB boundary, whatever the page size
HEADER_BYTES = 4096

_MAGIC = b"DSENGRM1"
_VERSION = 2  # 2: one region of records per table (1: separate code and scale regions)
STATE_LOADING, STATE_READY, STATE_FAILED = 0, 1, 2
STATE_NAMES = {STATE_LOADING: "loading", STATE_READY: "ready", STATE_FAILED: "failed"}
# magic, version, state, loader pid, expected attachers, attached, table count, unlinked flag,
# page size, total bytes, data bytes, loaded bytes, loader start time (clock ticks since boot).
_HEADER = struct.Struct("<8sIIIIIIIIQQQQ")
ERROR_OFFSET, ERROR_BYTES = 128, 512
_TABLE = struct.Struct("<qQIIQQ")  # layer id, rows, row bytes, scale columns, records offset, record bytes
_TABLES_OFFSET = ERROR_OFFSET + ERROR_BYTES
_MAX_TABLES = (HEADER_BYTES - _TABLES_OFFSET) // _TABLE.size


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


def layout_tables(specs: Sequence[EngramTableSpec], page_size: int) -> tuple[list[EngramTableLayout], int]:
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
    return layout_tables(specs, HUGE_PAGE_BYTES)[1]


@dataclass
class SegmentHeader:
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
    def read(cls, buffer: Any) -> SegmentHeader | None:
        """The header in ``buffer``, or None while the magic is not written yet."""
        fields = _HEADER.unpack_from(buffer, 0)
        if fields[0] != _MAGIC:
            return None
        if fields[1] != _VERSION:
            raise EngramStoreError(f"Engram segment has header version {fields[1]}, this code reads {_VERSION}")
        raw_error = bytes(buffer[ERROR_OFFSET : ERROR_OFFSET + ERROR_BYTES]).split(b"\0", 1)[0]
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
        """The whole header, the magic last: a reader takes the segment for one without a header until then."""
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
STATE_AT, ATTACHED_AT, UNLINKED_AT, LOADED_AT = 12, 24, 32, 56


def put_u32(buffer: Any, offset: int, value: int) -> None:
    struct.pack_into("<I", buffer, offset, value)


class HeaderLock:
    """``flock`` on the segment file: orders header updates between ranks (and is a memory barrier)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def read_header(fd: int, *, lock: bool = True) -> SegmentHeader | None:
    """The header of the segment open as ``fd`` (under :class:`HeaderLock` if ``lock``), or None while there is none."""
    if os.fstat(fd).st_size < HEADER_BYTES:
        return None
    with mmap.mmap(fd, HEADER_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as head:
        if not lock:
            return SegmentHeader.read(head)
        with HeaderLock(fd):
            return SegmentHeader.read(head)
