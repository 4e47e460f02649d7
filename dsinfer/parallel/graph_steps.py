"""Decode graphs on expert-parallel ranks: every step the ranks agree whether all of them replay one bucket.

A captured decode graph holds the fixed-capacity EP collectives (:mod:`dsinfer.parallel.ep_fixed`), so the
ranks may replay graphs only together, all the same bucket (the same collectives with the same shapes).
Before each forward every rank puts one number into a max all-reduce over the gloo control group (what
vLLM's data parallelism does with its token counts):

* ``len(spans)`` for a pure decode step that the decode graphs serve (:meth:`DecodeGraphs.serves`);
* 0 for a rank with nothing to run this step;
* ``largest bucket + 1`` for anything else (prefill, mixed steps, a batch past the largest bucket).

When the maximum fits a bucket, every rank replays the smallest bucket that holds it: a busy rank with its
sequences and padding rows, an idle rank with every row padding (the padding rows of
:class:`~dsinfer.engine.decode_graphs.DecodeGraphs` decode in the spare slot against the trash block). Else
every rank runs eagerly: busy ranks their forward, idle ranks :func:`~dsinfer.parallel.ep.run_idle_pass`, and
the dispatch takes its variable-size path. When the maximum is 0 nobody runs a forward this step.

With one rank there is nobody to agree with: the exchange is skipped and the engine runs the plain
single-rank graph path, with the EP dispatch inside the graph.

A speculative step (:class:`~dsinfer.speculative.executor.SpeculativeExecutor`) runs one target forward too (its
verify forward, prefill chunks included; the MTP and DSpark drafters hold whole experts and run no collective),
but not through the runner's ``execute``: it counts as this rank's forward of the step all the same. Ranks that
speculate run eagerly (the rank loop turns graphs off), so its forward meets the others' eager forwards or
idle passes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsinfer.engine.model_runner import ModelRunner, StepInput
from dsinfer.parallel.ep import ExpertParallel, run_idle_pass


class GraphStepAgreement:
    """Runs the rank's forwards (it replaces ``runner.execute``) and its idle passes, agreeing on graphs."""

    def __init__(self, runner: ModelRunner, dispatcher: ExpertParallel, control_group, world_size: int,
                 speculative=None) -> None:  # fmt: skip
        self.runner, self.dispatcher, self.group, self.world_size = runner, dispatcher, control_group, world_size
        self.graphs = runner.decode_graphs
        self.speculative = speculative  # the engine's SpeculativeExecutor, if any: its steps are forwards too
        self.forwards = 0  # forwards run through ``execute``
        self._forwards_before = 0
        self.graph_steps = 0  # forwards this rank ran in a decode bucket, with sequences
        self.padded_graph_steps = 0  # idle steps this rank ran as a bucket of padding rows
        self._runner_execute = runner.execute
        runner.split_mixed_steps = False  # one forward a step on every rank, so the collectives pair up
        runner.execute = self.execute  # the device worker calls the runner's execute for every forward

    def _all_forwards(self) -> int:
        return self.forwards + (self.speculative.steps if self.speculative is not None else 0)

    def begin_step(self) -> None:
        """Called by the rank loop before each engine step: :attr:`ran_forward` then tells whether it ran one."""
        self._forwards_before = self._all_forwards()

    @property
    def ran_forward(self) -> bool:
        """Whether the engine step since :meth:`begin_step` ran a forward (plain or speculative)."""
        return self._all_forwards() != self._forwards_before

    @property
    def _eager_vote(self) -> int:
        return self.graphs.sizes[-1] + 1

    def _agree(self, vote: int) -> int:
        if self.world_size == 1:
            return vote
        votes = torch.tensor([vote], dtype=torch.int64)
        dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.group)
        return int(votes.item())

    def _bucket(self, count: int) -> int:
        return next(size for size in self.graphs.sizes if size >= count)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """The step's logits [k, vocab], from a decode bucket when every rank can replay one, else eagerly."""
        self.forwards += 1
        graphs, runner = self.graphs, self.runner
        if graphs is None:
            return self._runner_execute(step)
        served = graphs.serves(step.spans, int(step.sample_rows.shape[0]))
        agreed = self._agree(len(step.spans) if served else self._eager_vote)
        if agreed < self._eager_vote:
            self.graph_steps += 1
            with self.dispatcher.fixed_capacity():  # what the graphs captured; eager on the CPU
                return graphs.run(step.input_ids, step.spans, size=self._bucket(agreed))
        if not served:
            return self._runner_execute(step)  # the runner's own eager forward
        return runner.model(runner.step_batch(step), logits_for=step.sample_rows)  # a step it would have graphed

    @torch.inference_mode()
    def idle(self, device: torch.device) -> None:
        """A step in which this rank ran no forward: join the others' collectives (or nobody's)."""
        graphs = self.graphs
        if graphs is None:
            run_idle_pass(self.runner.model, device)
            return
        agreed = self._agree(0)
        if agreed == 0:
            return  # no rank runs a forward this step
        if agreed < self._eager_vote:
            self.padded_graph_steps += 1
            empty = torch.empty(0, dtype=torch.long, device=device)
            with self.dispatcher.fixed_capacity():
                graphs.run(empty, [], size=self._bucket(agreed))
            return
        run_idle_pass(self.runner.model, device)
