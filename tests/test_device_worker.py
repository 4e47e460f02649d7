"""The device worker hands back a step before its tokens are on the host: the caller's handle waits for them.

The engine's own results with and without overlap are compared in tests/test_engine_overlap.py; here the
worker's contract alone, with a stand-in runner: the worker is free for the next step before anyone reads the
first step's outputs, the outputs are the sampler's, and a failed step's error reaches ``result()`` and
``exception()``.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from dsinfer.engine.device_worker import DeviceWorker
from dsinfer.sampling.sampler import PendingOutputs, Sampler, make_sampling_state
from dsinfer.sampling_params import SamplingParams


class StandInRunner:
    """``execute`` returns fixed logits, or raises; records which steps ran."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits, self.ran = logits, []

    def before_step(self) -> None:
        """Nothing to re-balance between steps."""

    def execute(self, batch):
        if batch.fail:
            raise RuntimeError("the forward failed")
        self.ran.append(batch.name)
        return self.logits


def _step(name: str, fail: bool = False):
    return SimpleNamespace(name=name, fail=fail, pending_fill=None, speculation=None)


def _states(count: int):
    return [make_sampling_state(SamplingParams(temperature=0.0), [1, 2], None) for _ in range(count)]


def test_the_worker_takes_the_next_step_before_the_first_steps_outputs_are_read():
    logits = torch.randn(3, 50)
    runner = StandInRunner(logits)
    worker = DeviceWorker(runner, Sampler(), threaded=True)
    try:
        first = worker.submit(_step("first"), _states(3))
        queued = threading.Event()
        second = worker.submit(_step("second"), _states(3), started=queued)
        assert queued.wait(timeout=30)  # the worker took the second step up; nobody has read the first yet
        assert isinstance(first._future.result(timeout=30), PendingOutputs)
        expected = logits.argmax(dim=-1).tolist()
        assert [out.token_ids[0] for out in first.result()] == expected
        assert [out.token_ids[0] for out in second.result()] == expected
        assert runner.ran == ["first", "second"]
        assert first.exception() is None
    finally:
        worker.close()


@pytest.mark.parametrize("threaded", [True, False])
def test_a_failed_step_reports_its_error(threaded):
    worker = DeviceWorker(StandInRunner(torch.randn(1, 8)), Sampler(), threaded=threaded)
    try:
        handle = worker.submit(_step("broken", fail=True), _states(1))
        with pytest.raises(RuntimeError, match="the forward failed"):
            handle.result()
        assert isinstance(handle.exception(), RuntimeError)
    finally:
        worker.close()


def test_pending_fill_copies_a_prefix_or_indexed_rows():
    """The steady decode step's fill is rows 0..k-1 from sampled rows 0..k-1 (one copy); any other is indexed."""
    from dsinfer.engine.model_runner import PendingFill

    sampled = torch.tensor([5, 6, 8])
    ids = torch.tensor([0, 0, 7])
    PendingFill(2).apply(ids, sampled)
    assert ids.tolist() == [5, 6, 7]
    ids = torch.tensor([9, 0, 0, 4])
    PendingFill(2, torch.tensor([1, 2]), torch.tensor([2, 0])).apply(ids, sampled)
    assert ids.tolist() == [9, 8, 5, 4]
