"""Removing the name of a segment whose loader is gone: the reaper process, and stale segments.

The package docstring (:mod:`dsinfer.engram.store`) lists every path by which a segment's name is
removed; this module holds the two that work without the loader: the reaper, a process that
unlinks the name when the loader dies without running Python code, and the removal of segments
whose loader is dead (:func:`remove_stale_segments`, and :func:`create_segment_file` replacing one).
"""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dsinfer.engram.store.errors import EngramStoreError
from dsinfer.engram.store.memory import SHM_DIR, hugetlbfs_mount
from dsinfer.engram.store.segment import read_header

__all__ = [
    "create_segment_file",
    "process_alive",
    "process_start_time",
    "remove_stale_segments",
    "start_reaper",
    "unlink_if_same",
]

logger = logging.getLogger(__name__)


def process_start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (0 when unknown): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return int(handle.read().rpartition(")")[2].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def process_alive(pid: int, start_time: int) -> bool:
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


def start_reaper(path: Path, stat: os.stat_result) -> tuple[int, subprocess.Popen]:
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


def unlink_if_same(path: Path, stat: os.stat_result) -> bool:
    """Unlink ``path`` if it still names the inode of ``stat``; True if this call removed it."""
    try:
        current = os.stat(path)
        if (current.st_dev, current.st_ino) != (stat.st_dev, stat.st_ino):
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


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
        header = read_header(fd, lock=False)
    except (OSError, EngramStoreError, struct.error):
        return None
    finally:
        os.close(fd)
    if header is None:
        return None
    return header.loader_pid, process_alive(header.loader_pid, header.loader_start_time)


def create_segment_file(path: Path) -> int:
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


def remove_stale_segments(directories: Sequence[Path] | None = None) -> list[Path]:
    """Unlink Engram segments whose loader is dead (leftovers of a host-wide ``kill -9``); returns them."""
    if directories is None:
        directories = [d for d in (SHM_DIR, hugetlbfs_mount()) if d is not None]
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
