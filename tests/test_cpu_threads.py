"""The engine's CPU threads follow the cores the process may use: affinity, then the cgroup quota (v2 and v1)."""

from __future__ import annotations

import pytest

from dsinfer.cpu_threads import cgroup_cpu_quota, engine_threads, usable_cpus


def eight_cores(_pid: int) -> set[int]:
    return set(range(8))


def test_cgroup_v2_quota_caps_the_affinity(tmp_path):
    (tmp_path / "cpu.max").write_text("250000 100000\n")  # docker --cpus 2.5
    assert cgroup_cpu_quota(tmp_path) == 2.5
    assert usable_cpus(eight_cores, tmp_path) == 3  # rounded up: the half core is still usable
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    assert usable_cpus(eight_cores, tmp_path) == 8


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("50000\n")
    assert usable_cpus(eight_cores, tmp_path) == 2
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cpus(eight_cores, tmp_path) == 8


def test_affinity_below_the_quota_wins(tmp_path):
    (tmp_path / "cpu.max").write_text("800000 100000\n")
    assert usable_cpus(lambda _pid: {3, 5}, tmp_path) == 2
    assert usable_cpus(lambda _pid: {3, 5}, tmp_path / "missing") == 2  # no cgroup files: affinity alone


def test_engine_threads_leave_the_http_process_one_core():
    assert engine_threads(None, reserved=1, cores=4) == 3
    assert engine_threads(None, reserved=1, cores=1) == 1  # never zero
    assert engine_threads(None, reserved=0, cores=6) == 6
    assert engine_threads(5, reserved=1, cores=2) == 5  # --cpu-threads overrides
    with pytest.raises(ValueError, match="cpu_threads"):
        engine_threads(0, reserved=1, cores=4)
