"""The :class:`EngramStore`: the Engram tables of one host, loaded once into a segment and mapped by every rank.

How loading, attaching and cleanup work is in the package docstring (:mod:`dsinfer.engram.store`).
"""

from __future__ import annotations

import atexit
import errno
import mmap
import os
import struct
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dsinfer import envs
from dsinfer.engram.store.errors import EngramMemoryError, EngramStoreError
from dsinfer.engram.store.memory import SHM_DIR, check_free_memory, choose_location, hugetlbfs_mount
from dsinfer.engram.store.reaper import (
    create_segment_file,
    process_alive,
    process_start_time,
    start_reaper,
    unlink_if_same,
)
from dsinfer.engram.store.segment import (
    ATTACHED_AT,
    ERROR_BYTES,
    ERROR_OFFSET,
    HUGE_PAGE_BYTES,
    LOADED_AT,
    STATE_AT,
    STATE_FAILED,
    STATE_LOADING,
    STATE_NAMES,
    STATE_READY,
    UNLINKED_AT,
    EngramTableLayout,
    HeaderLock,
    SegmentHeader,
    layout_tables,
    put_u32,
    read_header,
    table_records,
)
from dsinfer.engram.store.sources import EngramSource

if TYPE_CHECKING:
    import torch

__all__ = ["ATTACH_TIMEOUT_ENV", "EngramStore", "default_segment_name"]

ATTACH_TIMEOUT_ENV = envs.ENGRAM_ATTACH_TIMEOUT.name
DEFAULT_ATTACH_TIMEOUT_S = envs.ENGRAM_ATTACH_TIMEOUT.default
_POLL_S = 0.01


def default_segment_name(key: str = "") -> str:
    """A segment name every local rank of one job computes alike.

    From ``DSINFER_ENGRAM_SEGMENT`` if set; otherwise from ``key`` (say the checkpoint path) and the
    launcher's rendezvous (``MASTER_ADDR``/``MASTER_PORT``), so two jobs on one host do not collide.
    """
    explicit = envs.ENGRAM_SEGMENT.get()
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
        header: SegmentHeader,
        is_loader: bool,
        stat: os.stat_result,
        huge_pages_fallback: str | None = None,
        reaper: tuple[int, subprocess.Popen] | None = None,
    ):
        self.path = path
        self.name = path.name
        self.inode = stat.st_ino
        """The segment file's inode: tells this segment's mapping (``/proc/<pid>/maps`` lists it) from another
        of the same name."""
        self._mapping: mmap.mmap | None = mapping
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
        directory, page_size, fallback = choose_location(specs, huge_pages)
        layouts, total = layout_tables(specs, page_size)
        if check_memory:
            check_free_memory(directory, page_size == HUGE_PAGE_BYTES, total)
        path = directory / name
        fd = create_segment_file(path)
        stat = os.fstat(fd)
        reaper = None
        mapping = None
        try:
            reaper = start_reaper(path, stat)
            mapping = _reserve_and_map(fd, total, path)
            header = _loading_header(attachers, page_size, total, sum(spec.table_bytes for spec in specs), layouts)
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
            unlink_if_same(path, stat)
            os.close(fd)
            if reaper is not None:
                os.close(reaper[0])
            raise
        try:
            store._load(source, fd)
            with HeaderLock(fd):
                put_u32(mapping, STATE_AT, STATE_READY)
                if attachers == 0:
                    store._unlink_name(fd)
        except BaseException as exc:
            store._fail(fd, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            os.close(fd)
        return store

    def _load(self, source: EngramSource, fd: int) -> None:
        loaded = 0
        lock = threading.Lock()  # sources report from their reader threads

        def progress(n: int) -> None:
            nonlocal loaded
            with lock:
                loaded += n
                struct.pack_into("<Q", self._mapping, LOADED_AT, loaded)

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
            encoded = message.encode("utf-8", "replace")[: ERROR_BYTES - 1]
            with HeaderLock(fd):
                self._mapping[ERROR_OFFSET : ERROR_OFFSET + ERROR_BYTES] = encoded.ljust(ERROR_BYTES, b"\0")
                put_u32(self._mapping, STATE_AT, STATE_FAILED)
        finally:
            self.close()

    def _unlink_name(self, fd: int) -> None:
        """Remove the name (caller holds the lock); the memory lives on while anyone maps it."""
        unlink_if_same(self.path, self._stat)
        put_u32(self._mapping, UNLINKED_AT, 1)

    @classmethod
    def attach(cls, name: str, *, timeout: float | None = None) -> EngramStore:
        """Wait (up to ``timeout`` s) for segment ``name`` to be ready, map it, and count this rank in."""
        _check_name(name)
        if timeout is None:
            timeout = envs.ENGRAM_ATTACH_TIMEOUT.get()
        deadline = time.monotonic() + timeout
        candidates = [d / name for d in (hugetlbfs_mount(), SHM_DIR) if d is not None]
        last_seen: SegmentHeader | None = None
        # Once the file is found its descriptor stays open while waiting: the inode then outlives an
        # unlink, so a failed or dead loader's last header is still readable here.
        fd: int | None = None
        try:
            while True:
                if fd is None:
                    fd, path = cls._open_existing(candidates)
                if fd is not None:
                    header = read_header(fd)
                    if header is not None:
                        last_seen = header
                        if header.state == STATE_FAILED:
                            raise EngramStoreError(
                                f"the Engram loader (pid {header.loader_pid}) failed to load {path}: {header.error}"
                            )
                        if header.state == STATE_READY:
                            return cls._map_ready(path, fd)
                        if not process_alive(header.loader_pid, header.loader_start_time):
                            raise _loader_died(header, path)
                    if os.fstat(fd).st_nlink == 0:  # unlinked while we waited
                        if header is not None and _dies_soon(header):
                            raise _loader_died(header, path)  # its reaper ran while the loader was still exiting
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
    def _timeout_error(
        name: str, candidates: Sequence[Path], timeout: float, header: SegmentHeader | None
    ) -> Exception:
        where = " or ".join(str(p) for p in candidates)
        if header is None:
            return EngramStoreError(
                f"timed out after {timeout:.0f} s waiting for the Engram segment {where} to appear (is local rank 0 "
                f"loading it under the same name? set {ATTACH_TIMEOUT_ENV} to wait longer)"
            )
        return EngramStoreError(
            f"timed out after {timeout:.0f} s waiting for the Engram segment {where} to become ready: state "
            f"{STATE_NAMES.get(header.state, header.state)}, loader pid {header.loader_pid}, "
            f"{header.loaded_bytes:,} of {header.data_bytes:,} bytes loaded (set {ATTACH_TIMEOUT_ENV} to wait longer)"
        )

    @classmethod
    def _map_ready(cls, path: Path, fd: int) -> EngramStore:
        size = os.fstat(fd).st_size
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        stat = os.fstat(fd)
        with HeaderLock(fd):
            header = SegmentHeader.read(mapping)
            attached = header.attached + 1
            put_u32(mapping, ATTACHED_AT, attached)
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

        if self._closed:
            raise EngramStoreError(f"Engram store {self.name} is closed")
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
        :meth:`weight` / :meth:`scale` still alive elsewhere keep this process's mapping until the last of
        them goes (the store lets go of the mapping here, so an object still referring to the store keeps
        nothing mapped).
        """
        if self._closed:
            return
        self._closed = True
        if self.is_loader:
            atexit.unregister(self.close)
            unlink_if_same(self.path, self._stat)
        self._tensors.clear()
        self._base = None
        mapping, self._mapping = self._mapping, None
        try:
            mapping.close()
        except BufferError:
            pass  # a tensor over it is still alive: its memoryview holds the mmap, which unmaps when the last goes
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


def _reserve_and_map(fd: int, total: int, path: Path) -> mmap.mmap:
    """The new segment file sized to ``total`` bytes, reserved up front (a full memory file system fails here with
    a clear error, not later as a fault while loading) and mapped shared, populated where the platform can."""
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
    return mmap.mmap(fd, total, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _loading_header(
    attachers: int, page_size: int, total: int, data_bytes: int, layouts: list[EngramTableLayout]
) -> SegmentHeader:
    """The header this process writes as the segment's loader: loading, nothing attached or loaded yet."""
    pid = os.getpid()
    return SegmentHeader(
        STATE_LOADING, pid, attachers, 0, len(layouts), 0, page_size, total, data_bytes, 0,
        process_start_time(pid), "", layouts,
    )  # fmt: skip


def _loader_died(header: SegmentHeader, path) -> EngramStoreError:
    return EngramStoreError(
        f"the Engram loader (pid {header.loader_pid}) died while loading {path} "
        f"({header.loaded_bytes:,} of {header.data_bytes:,} bytes loaded); its reaper removes the segment"
    )


def _dies_soon(header: SegmentHeader, within_s: float = 0.5) -> bool:
    """Whether the segment's loader is gone (or goes within ``within_s``: a killed process closes its files, which
    wakes the reaper, before it stops showing as running)."""
    deadline = time.monotonic() + within_s
    while process_alive(header.loader_pid, header.loader_start_time):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True
