"""The device worker: runs prepared steps (forward, then sampling) in order, on its own thread.

The engine thread hands over a step already turned into plain data (:meth:`ModelRunner.prepare`) with the
sampling states of the sequences it samples, and gets a :class:`StepHandle` of their
:class:`~dsinfer.sampling.sampler.SampleOutput` list. One thread runs every step in submission order, so a
step's cache writes always land before the next step reads; the engine thread meanwhile schedules the next
step (torch releases the Python lock inside its kernels and device synchronisations).

A step may be handed over before the host has read the tokens of the step ahead of it (overlap scheduling's
launch-ahead, :meth:`LLMEngine.step`): its ``pending_fill`` names the rows whose input token is one the
previous step sampled, and the worker copies them from that step's device tensor just before the forward. No
value crosses to the host between the two steps, so the device runs them back to back.

The worker does not wait for a step's tokens itself: it queues the sampler's kernels and the copies of its
results to the host, and goes on to the next step, which the device then runs right behind this one. The
caller's :meth:`StepHandle.result` does the waiting (without the Python lock), so the device is never idle
between two steps for the host's read, the Python hand-offs between the threads and the next step's launch.

``threaded=False`` runs each step inline on the caller's thread and returns a finished future: the same
contract, no overlap. This is the shape of one worker per rank: a later multi-rank engine keeps the
engine core and gives each rank a worker of its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from dsinfer.sampling.sampler import PendingOutputs, SampleOutput, Sampler, SamplingState

if TYPE_CHECKING:
    from dsinfer.engine.model_runner import ModelRunner, StepInput
    from dsinfer.speculative.executor import SpeculativeExecutor


class StepHandle:
    """A submitted step: ``result()`` waits for the worker to take it up and launch it, then for its outputs."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self) -> list[SampleOutput]:
        outputs = self._future.result()
        return outputs.result() if isinstance(outputs, PendingOutputs) else outputs

    def exception(self) -> BaseException | None:
        """The step's error, if it failed (waits for it like ``result()``), else None."""
        try:
            self.result()
        except BaseException as error:  # handed to the caller, as Future.exception does
            return error
        return None


class DeviceWorker:
    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        threaded: bool = True,
        speculative: SpeculativeExecutor | None = None,
    ) -> None:
        self.runner, self.sampler, self.speculative = runner, sampler, speculative
        self._sampled_tokens = None  # the last step's chosen ids on the device; None when it sampled nothing
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsinfer-device") if threaded else None

    def submit(
        self,
        batch: StepInput,
        states: list[SamplingState],
        output_positions: list[int] | None = None,
        started: threading.Event | None = None,
    ) -> StepHandle:
        """Queue a step; the handle's ``result()`` gives one sample output per state (none without samples).

        ``output_positions``: each state's output position, as planned (see :class:`Sampler`). ``started``: the
        worker is still running the step before this one, so return at once; the worker sets this event when it
        takes the step up (the caller waits on it to hand the worker the Python lock then)."""
        if self._pool is not None:
            queued = started is not None
            started = started if queued else threading.Event()
            future = self._pool.submit(self._run, batch, states, output_positions, started)
            if not queued:
                # Hand the Python lock to the worker now: otherwise it would start the forward only once the
                # engine thread blocks, after the scheduling it was meant to overlap.
                started.wait()
            return StepHandle(future)
        future: Future = Future()
        try:
            outputs = self._run(batch, states, output_positions)
            future.set_result(outputs.result() if isinstance(outputs, PendingOutputs) else outputs)
        except Exception as exc:  # the caller sees it from result(), as with the threaded worker
            future.set_exception(exc)
        return StepHandle(future)

    def _run(
        self,
        batch: StepInput,
        states: list[SamplingState],
        output_positions: list[int] | None = None,
        started: threading.Event | None = None,
    ) -> list[SampleOutput] | PendingOutputs:
        if started is not None:
            started.set()
        previous, self._sampled_tokens = self._sampled_tokens, None
        if batch.pending_fill is not None:
            if previous is None:
                raise RuntimeError("a step launched ahead follows a step that sampled no tokens")
            batch.pending_fill.apply(batch.input_ids, previous)
        self.runner.before_step()
        if batch.speculation is not None:
            return self.speculative.run(batch, states)
        logits = self.runner.execute(batch)
        if not states:
            return []
        outputs = self.sampler.launch(logits, states, output_positions)
        self._sampled_tokens = self.sampler.last_token_ids
        return outputs

    def run_between_steps(self, work: Callable[[], object]) -> object:
        """``work()`` on the worker's thread once the steps queued before it have run, and its result: a change
        to what the steps use (a CUDA graph recorded again) never races a step."""
        if self._pool is None:
            return work()
        return self._pool.submit(work).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
