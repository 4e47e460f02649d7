"""``benchmarks/host_step.py --device-queue``: the stand-in device runs queued work in order while the host goes
on, and reading results back waits for the work queued before it, not for work queued after."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from dsinfer.sampling.host_copies import HostCopies, start_read_back

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture
def device(monkeypatch):
    from host_step import QueuedDevice

    monkeypatch.setattr(HostCopies, "__init__", HostCopies.__init__)  # restored after the test
    monkeypatch.setattr(HostCopies, "wait", HostCopies.wait)
    return QueuedDevice.install()


def test_read_back_waits_for_the_work_queued_before_it(device):
    start = time.perf_counter()
    device.queue(40.0)
    device.queue(40.0)  # in order: the copies land after both
    queued = time.perf_counter() - start
    copies = start_read_back(torch.arange(3))
    device.queue(200.0)  # queued after the copies: they do not wait for it
    (values,) = copies.wait()
    waited = time.perf_counter() - start
    assert queued < 0.04, "queueing must not block the host"
    assert 0.075 <= waited < 0.2, waited
    assert values.tolist() == [0, 1, 2]


def test_copies_made_before_any_work_do_not_wait(device):
    copies = start_read_back(torch.ones(2))
    device.queue(500.0)
    start = time.perf_counter()
    copies.wait()
    assert time.perf_counter() - start < 0.1
