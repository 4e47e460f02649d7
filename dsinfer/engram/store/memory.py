"""How much shared memory a host has for an Engram segment, and where the segment goes (``/dev/shm`` or hugetlbfs).


**Huge pages.** ``huge_pages=True`` puts the segment on a hugetlbfs mount (``DSINFER_HUGETLBFS``,
or the first ``hugetlbfs`` in ``/proc/mounts``) when enough free 2 MiB pages exist; otherwise it
logs why and falls back to 4 KiB pages in ``/dev/shm`` (:attr:`EngramStore.huge_pages_fallback`
holds the reason). Huge pages cut the host page-table entries behind a 200 GB table 512-fold and
make loading about twice as fast (docs/perf.md, history, 2026-11-29, third round); on the H200 VM of
``benchmarks/engram_fetch.py`` they did not speed up the GPU's scattered reads, whose translation
happens outside the guest (the host IOMMU; memory from ``cuMemCreate`` at 2 MiB granularity reads
alike). Not measured on bare metal. The CPU's own scattered reads (the ``staged`` host method) ran
alike with either page size (docs/perf.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from dsinfer import envs
from dsinfer.engram.store.errors import EngramMemoryError
from dsinfer.engram.store.segment import HUGE_PAGE_BYTES, SMALL_PAGE_BYTES, EngramTableSpec, layout_tables

__all__ = [
    "HUGETLBFS_ENV",
    "SHM_DIR",
    "available_shared_memory",
    "check_free_memory",
    "choose_location",
    "hugetlbfs_mount",
    "meminfo",
]

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
HUGETLBFS_ENV = envs.HUGETLBFS.name


def meminfo() -> dict[str, int]:
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
    info = meminfo()
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


def check_free_memory(directory: Path, huge_pages: bool, needed: int) -> None:
    available, detail = available_shared_memory(directory, huge_pages)
    if needed > available:
        raise EngramMemoryError(
            f"the Engram tables need {needed:,} bytes ({needed / 2**30:.2f} GiB) of shared memory but only "
            f"{available:,} bytes ({available / 2**30:.2f} GiB) are available ({detail}); free memory, use a host "
            "with more RAM, or choose the 'sharded' Engram placement"
        )


def hugetlbfs_mount() -> Path | None:
    """``$DSINFER_HUGETLBFS``, else the first 2 MiB hugetlbfs in ``/proc/mounts``."""
    override = envs.HUGETLBFS.get()
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


def choose_location(specs: Sequence[EngramTableSpec], huge_pages: bool) -> tuple[Path, int, str | None]:
    """hugetlbfs when asked for and usable, else /dev/shm; the third item says why huge pages were not used."""
    if not huge_pages:
        return SHM_DIR, SMALL_PAGE_BYTES, None
    mount = hugetlbfs_mount()
    needed = layout_tables(specs, HUGE_PAGE_BYTES)[1]
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
