"""How many torch threads the engine runs on a CPU: the cores this process may use, less one for the HTTP server.

torch starts one thread per core of the machine, whatever the process is allowed: in a container limited to
two CPUs of a 64-core host, or beside a second process (the server's HTTP process and its engine process each
start a thread per core), the threads fight for the same cores and a decode step takes ten times longer. The
cores a process may really use are the smaller of its CPU affinity (``os.sched_getaffinity``, what
``taskset`` and Kubernetes' static CPU manager set) and its cgroup quota (``cpu.max`` in cgroup v2,
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1: what ``docker --cpus`` sets). ``--cpu-threads`` overrides the
choice; so does ``OMP_NUM_THREADS`` set by the user.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup quota allows (2.5 for ``250000 100000``), or None when it sets no limit."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # cgroup v2: "max 100000" means no limit
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())  # cgroup v1: -1 means no limit
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cpus(affinity: Callable[[int], set[int]] | None = None, cgroup_root: Path = CGROUP_ROOT) -> int:
    """Whole CPUs this process may use: its affinity, capped by the cgroup quota (rounded up), at least 1."""
    get_affinity = affinity or getattr(os, "sched_getaffinity", None)
    cores = len(get_affinity(0)) if get_affinity is not None else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(cgroup_root)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def engine_threads(requested: int | None, *, reserved: int, cores: int | None = None) -> int:
    """torch threads for the engine: ``requested`` if given, else the usable cores less ``reserved`` (the HTTP
    process's one core when it runs beside the engine), at least 1."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {requested}")
        return requested
    return max(1, (cores if cores is not None else usable_cpus()) - reserved)


def user_set_threads() -> int | None:
    """The thread count the user fixed with ``OMP_NUM_THREADS`` (it wins over our choice), or None."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def apply_cpu_threads(
    requested: int | None, device: str, *, reserved: int, engine_elsewhere: bool = False
) -> int | None:
    """Set this process's torch threads (and ``OMP_NUM_THREADS`` for engine processes it starts) for a CPU run.

    Returns the engine's thread count, or None on a GPU (its host threads only launch kernels). With
    ``engine_elsewhere`` the engine runs in processes of its own: they read ``OMP_NUM_THREADS`` when they start
    torch, and this process (HTTP, tokenizing) keeps one thread.
    """
    import torch

    if torch.device(device).type != "cpu":
        return None
    chosen = engine_threads(requested or user_set_threads(), reserved=reserved)
    os.environ["OMP_NUM_THREADS"] = str(chosen)
    torch.set_num_threads(1 if engine_elsewhere else chosen)
    return chosen
