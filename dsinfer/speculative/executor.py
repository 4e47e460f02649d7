"""Speculative decoding in the engine: one step verifies every sequence's drafts and drafts the next ones.

A step whose sequences carry drafts (``Sequence.draft_token_ids``, scheduled behind their last token) runs here
instead of the plain forward + sampler:

1. the target forward over the whole packed batch (prefill chunks of other requests included), keeping what the
   drafter reads of the target (``ServedModel.forward_for_drafter``; V4: the residual streams; V4.1: the
   captured target-layer hiddens); verify spans record their compressor updates and are snapshotted first,
   all spans at once;
2. each sampled sequence's rows are judged (:mod:`dsinfer.speculative.verify`) with ``min_tokens``, penalties
   and the grammar applied as if the earlier drafts were already part of the output; greedy rows accept drafts
   equal to the argmax, sampled rows use rejection sampling (:mod:`dsinfer.speculative.rejection`) with counter-based
   randomness keyed by the request's seed and output position (seeded replay, batch invariance); sequences
   without drafts draw exactly what plain decoding draws. Sequences without a grammar or penalties are judged
   together in one device computation and read back in one host read; the others one at a time;
3. the cache writes of rejected positions are undone, every verify span at once (:mod:`dsinfer.speculative.rollback`);
4. the drafter reads every kept position and drafts the next tokens of every sequence in one pass: V4's MTP
   layer (:mod:`dsinfer.speculative.mtp`, ``method: mtp``) or V4.1's DSpark stages (:mod:`dsinfer.speculative.dspark`,
   ``method: dspark``), whose drafts come back in one more host read.

The engine then appends the emitted tokens one at a time (stop rules inside an accepted run cut it there).

A step in which every sequence decodes (no prefill chunk, no Engram history to rebuild) runs from CUDA graphs
when the engine has them (:mod:`dsinfer.speculative.graphs`; the same static buffers run eagerly on the CPU when
``cuda_graph_sizes`` are given): the verify replay (snapshot, forward, greedy judge on the device), the draft
replay (rollback, drafts), one host read; sampled requests and ``min_tokens`` masks are judged on the device too
(:mod:`dsinfer.speculative.fixed_judge`), requests with a grammar, penalties or logprobs on the host between the
replays. A mixed step whose leading decodes the graphs serve is run as two: those sequences from the graphs, then
the prefill chunks after them on the eager path. Any other step takes the eager path above. Where the graphs are
captured, a sequence whose prompt ends in an eager step drafts in its next step's draft replay instead
(``defer_first_drafts``; that step verifies its token with filler drafts).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from dsinfer.config import SpeculativeConfig
from dsinfer.config.speculative import read_draft_token_map
from dsinfer.kv.batch import PackedBatch, SequenceSpan, host_to_device
from dsinfer.kv.cache_v4 import KVCache
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.models.served import ServedModel
from dsinfer.sampling.sampler import Sampler, SamplingState
from dsinfer.speculative.drafting import Drafter, DraftInput
from dsinfer.speculative.dspark import DSparkDrafter
from dsinfer.speculative.graphs import SpecGraphs
from dsinfer.speculative.mtp import MTPDrafter
from dsinfer.speculative.rollback import CacheRollback
from dsinfer.speculative.verify import (
    SpeculativeOutput,
    judge_batched,
    needs_own_pass,
    speculative_output,
    verify_sequence,
)


class StepRunner(Protocol):
    """What the executor reads of the engine's model runner (the engine sits above this package: a protocol, not
    an import)."""

    model: ServedModel
    cache: KVCache | KVCacheV41
    graph_sizes: tuple[int, ...] | None  # CUDA-graph batch buckets; None: steps run eagerly
    spare_slot: int
    max_model_len: int
    capture_graphs: bool
    float32: bool  # the model's linears are float32 (which BLAS each graph records under)

    def step_batch(self, step: Any) -> PackedBatch:
        """The step's packed batch over the cache, once what its forward needs first is done."""
        ...


logger = logging.getLogger(__name__)


@dataclass
class SpeculationPlan:
    """Per span of a step: its drafts (the last ``len`` rows), and the token after it when it is not sampled."""

    drafts: list[list[int]]
    following_token: list[int | None]  # prompt token after a prefill chunk; None for a sampled span
    token_ids: list[int]  # the step's input ids on the host (the drafter's inputs are built from them)


@dataclass
class SpeculativeStats:
    """Totals since start (vLLM's spec-decode counters): verify rounds with drafts, drafts, accepted drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if not num_drafts:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @classmethod
    def total(cls, parts: Iterable[SpeculativeStats | None]) -> SpeculativeStats | None:
        """The sum of several engines' totals (data-parallel ranks each verify their own requests); None when
        none of them speculates."""
        present = [part for part in parts if part is not None]
        if not present:
            return None
        width = max(len(part.accepted_per_position) for part in present)
        return cls(
            sum(part.num_drafts for part in present),
            sum(part.num_draft_tokens for part in present),
            sum(part.num_accepted_tokens for part in present),
            [sum(part.accepted_per_position[i] for part in present if i < len(part.accepted_per_position))
             for i in range(width)],
        )  # fmt: skip

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verify round: 1 + accepted drafts per round (tau)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


def build_drafter(model, cache, config: SpeculativeConfig) -> Drafter:
    """The drafter of ``config.method`` over the engine cache (the checkpoint was checked to support it)."""
    if config.method == "dspark":
        return DSparkDrafter(model, cache, config.num_speculative_tokens, config.confidence_threshold)
    token_map = None if config.draft_token_map is None else read_draft_token_map(config.draft_token_map)
    return MTPDrafter(model, cache, config.num_speculative_tokens, token_map)


class SpeculativeExecutor:
    """Runs steps that verify drafts and draft again, on the device worker (see the module docstring)."""

    def __init__(self, runner: StepRunner, sampler: Sampler, config: SpeculativeConfig) -> None:
        self.runner, self.model, self.cache, self.sampler = runner, runner.model, runner.cache, sampler
        self.drafter = build_drafter(self.model, self.cache, config)
        self.rollback = CacheRollback(self.cache, self.model.config.num_hidden_layers, self.model.engram_hasher)
        # Steps run here since start, those the graphs served, and those split into a graphed head and the rest.
        self.steps = self.graphed_steps = self.split_steps = 0
        # A benchmark's stand-in for judging (``dsinfer.bench.coin_acceptance``: drafts accepted by a seeded coin,
        # for timing models whose random weights draft badly); no engine or server option sets it.
        self.judge_override: Callable[[list[list[int]]], list[tuple[int, int]]] | None = None
        self.graphs: SpecGraphs | None = None
        if runner.graph_sizes is not None:
            if config.num_speculative_tokens + 1 > self.model.config.sliding_window:
                logger.info("speculative CUDA graphs off: K + 1 positions overrun the sliding window")
            else:
                self.graphs = SpecGraphs(self.drafter, self.rollback, runner.graph_sizes, runner.spare_slot,
                                         runner.max_model_len, runner.capture_graphs, runner.float32)  # fmt: skip
        # Where the graphs are captured, a sequence whose prompt just ended drafts in its next step's draft replay
        # instead of eagerly, op by op from the host: that step verifies its token with filler drafts (one token
        # where a round gives tau; docs/speculative.md). The CPU runs its buckets eagerly anyway.
        self.defer_first_drafts = self.graphs is not None and runner.capture_graphs

    def run(self, step, states: list[SamplingState]) -> list[SpeculativeOutput]:
        """Forward, judge, roll back, draft (the judging runs outside inference mode, as the plain sampler does)."""
        self.steps += 1
        if self.graphs is not None and self.graphs.serves(step):
            self.graphed_steps += 1
            return self._run_graphed(step, states)
        split = self._graphed_head(step)
        if split is not None:
            self.split_steps += 1
            head, rest = split
            count = len(head.spans)
            return self._run_graphed(head, states[:count]) + self._run_eager(rest, states[count:])
        return self._run_eager(step, states)

    def _graphed_head(self, step) -> tuple[Any, Any] | None:
        """A mixed step as two steps, when the graphs serve its leading decodes (the scheduler puts them first): those
        sequences, and the prefill chunks after them; None when the graphs serve no such head."""
        plan: SpeculationPlan = step.speculation
        if self.graphs is None or step.image_pieces:  # image pieces number the whole step's rows
            return None
        count = 0
        for span, drafts, following in zip(step.spans, plan.drafts, plan.following_token, strict=True):
            if following is not None or span.length != 1 + len(drafts):
                break
            count += 1
        if not 0 < count < len(step.spans):
            return None
        rows = sum(span.length for span in step.spans[:count])  # every one sampled: a last token and its drafts
        head = replace(
            step, input_ids=step.input_ids[:rows], positions=step.positions[:rows], spans=step.spans[:count],
            sample_rows=step.sample_rows[:rows], engram_resume=None, image_pieces=None,
            speculation=SpeculationPlan(plan.drafts[:count], plan.following_token[:count], plan.token_ids[:rows]),
        )  # fmt: skip
        if not self.graphs.serves(head):
            return None
        rest = replace(
            step, input_ids=step.input_ids[rows:], positions=step.positions[rows:], spans=step.spans[count:],
            sample_rows=step.sample_rows[rows:] - rows,
            speculation=SpeculationPlan(plan.drafts[count:], plan.following_token[count:], plan.token_ids[rows:]),
        )  # fmt: skip
        return head, rest

    def _run_eager(self, step, states: list[SamplingState]) -> list[SpeculativeOutput]:
        """The step as one packed forward, judged, rolled back and drafted (the module docstring's steps 1-4)."""
        plan: SpeculationPlan = step.speculation
        with torch.inference_mode():
            batch = self.runner.step_batch(step)  # Engram history restored first: the snapshots see it
            verifying, rows, offset = [], [], 0
            for index, (span, drafts) in enumerate(zip(step.spans, plan.drafts, strict=True)):
                if drafts:
                    verifying.append(index)
                    rows += range(offset, offset + span.length)
                    span.journal = []
                offset += span.length
            snapshot = None
            if verifying:
                tokens = None  # V4.1's Engram look-back is rebuilt from the accepted tokens
                if self.rollback.engram_history is not None:
                    tokens = step.input_ids.index_select(0, host_to_device(rows, torch.long, step.input_ids.device))
                snapshot = self.rollback.snapshot_spans([step.spans[i] for i in verifying], tokens)
            logits, target_hidden = self.model.forward_for_drafter(batch, step.sample_rows)
        outputs = self._judge(logits, plan, states) if self.judge_override is None else self._overridden_judge(plan)
        with torch.inference_mode():
            self._roll_back_and_draft(step, target_hidden, plan, outputs, verifying, snapshot)
        return outputs

    def _run_graphed(self, step, states: list[SamplingState]) -> list[SpeculativeOutput]:
        """The same step from the graphs: the verify replay (snapshot, forward, greedy judge; then the sampled
        judge when a sequence samples), the draft replay (rollback, drafts), one host read. A step with a sequence
        the device judge cannot decide is judged on the host between the replays, from the verify logits."""
        graphs, plan = self.graphs, step.speculation
        with torch.inference_mode():
            run = graphs.prepare(step)
            judged_on_device = self.judge_override is None and graphs.plan_judge(run, states)
            graphs.verify(run)
        outputs = None
        if self.judge_override is not None:
            outputs = self._overridden_judge(plan)
        elif not judged_on_device:
            outputs = self._judge(graphs.judged_logits(run), plan, states)
        if outputs is not None:
            with torch.inference_mode():
                graphs.take_judgement(run, [(output.num_accepted, output.token_ids[-1]) for output in outputs])
        with torch.inference_mode():
            results = graphs.finish(run)
        if outputs is None:
            drafts = (d for d, token in zip(plan.drafts, plan.following_token, strict=True) if token is None)
            outputs = [SpeculativeOutput(d[: r.num_accepted] + [r.last_token], None, None, len(d), r.num_accepted)
                       for d, r in zip(drafts, results, strict=True)]  # fmt: skip
        for output, result in zip(outputs, results, strict=True):
            output.next_drafts = result.next_drafts
        return outputs

    def _overridden_judge(self, plan: SpeculationPlan) -> list[SpeculativeOutput]:
        """The benchmark stand-in's verdicts (accepted drafts, the token after them) as the step's outputs."""
        drafts = [d for d, token in zip(plan.drafts, plan.following_token, strict=True) if token is None]
        return [SpeculativeOutput(d[:accepted] + [last], None, None, len(d), accepted)
                for d, (accepted, last) in zip(drafts, self.judge_override(drafts), strict=True)]  # fmt: skip

    def _roll_back_and_draft(self, step, target_hidden, plan: SpeculationPlan, outputs, verifying, snapshot) -> None:
        """Undo the rejected positions' cache writes (every verify span at once), then draft from the kept
        positions."""
        sampled = [i for i, token in enumerate(plan.following_token) if token is None]
        kept = [span.length for span in step.spans]
        for index, output in zip(sampled, outputs, strict=True):
            kept[index] = step.spans[index].length - len(plan.drafts[index]) + output.num_accepted
        if snapshot is not None:
            journals = [step.spans[i].journal for i in verifying]
            self.rollback.rollback_spans(snapshot, journals, [kept[i] for i in verifying])
            for i in verifying:
                step.spans[i].journal = None
        inputs = self._draft_input(step, target_hidden, plan, outputs, sampled, kept)
        next_drafts = iter(self.drafter.draft(inputs))
        drafting = set(inputs.drafting)  # indices of the step's spans: the drafter's spans are the step's, in order
        for index, output in zip(sampled, outputs, strict=True):
            output.next_drafts = next(next_drafts) if index in drafting else []

    def _judge(self, logits: torch.Tensor, plan: SpeculationPlan, states: list[SamplingState]):
        """One output per sampled sequence. Sequences without a grammar or penalties are judged together (one
        host read for all); the others one at a time, through the plain sampler when they have no drafts."""
        drafts = [d for d, token in zip(plan.drafts, plan.following_token, strict=True) if token is None]
        row_of, row = [], 0
        for d in drafts:
            row_of.append(row)
            row += len(d) + 1
        outputs: list[SpeculativeOutput | None] = [None] * len(states)
        batched = [i for i, state in enumerate(states) if not needs_own_pass(state)]
        if batched:
            judged = judge_batched(logits, [row_of[i] for i in batched], [drafts[i] for i in batched],
                                   [states[i] for i in batched])  # fmt: skip
            for i, output in zip(batched, judged, strict=True):
                outputs[i] = output
        plain = [i for i, state in enumerate(states) if needs_own_pass(state) and not drafts[i]]
        if plain:
            index = host_to_device([row_of[i] for i in plain], torch.long, logits.device)
            for i, out in zip(plain, self.sampler(logits.index_select(0, index), [states[i] for i in plain]),
                              strict=True):  # fmt: skip
                outputs[i] = SpeculativeOutput(out.token_ids, out.logprobs, out.top_logprobs)
        for i, d in enumerate(drafts):
            if d and outputs[i] is None:
                rows = logits[row_of[i] : row_of[i] + len(d) + 1]
                tokens, _ = verify_sequence(rows, d, states[i])
                outputs[i] = speculative_output(rows, tokens, d, states[i])
        return outputs

    @staticmethod
    def _ends_prompt(span, drafts: list[int]) -> bool:
        """A sampled span that is its prompt's last chunk (several positions, none of them drafts)."""
        return not drafts and span.length > 1

    def _draft_input(self, step, target_hidden, plan, outputs, sampled, kept) -> DraftInput:
        """The kept positions of every span, each with the token after it, for the drafter: every span updates the
        drafter's state; the sampled ones draft, except a prompt's last chunk when first drafts are deferred."""
        emitted = dict(zip(sampled, outputs, strict=True))
        rows, next_ids, positions, spans, drafting = [], [], [], [], []
        offset = 0
        for index, span in enumerate(step.spans):
            count = kept[index]
            ids = plan.token_ids[offset : offset + count]
            after = plan.following_token[index]
            following = ids[1:] + [emitted[index].token_ids[-1] if after is None else after]
            rows += range(offset, offset + count)
            next_ids += following
            positions += range(span.start, span.start + count)
            if index in emitted and not (self.defer_first_drafts and self._ends_prompt(span, plan.drafts[index])):
                drafting.append(len(spans))
            spans.append(SequenceSpan(span.start, count, span.slot, span.block_table, span.reuse_below,
                                      span.window_from))  # fmt: skip
            offset += span.length
        device = target_hidden.device
        return DraftInput(
            target_hidden[host_to_device(rows, torch.long, device)],
            host_to_device(next_ids, torch.long, device),
            host_to_device(positions, torch.long, device),
            spans,
            drafting,
        )
