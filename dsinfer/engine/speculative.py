"""Speculative decoding in the engine: one step verifies every sequence's drafts and drafts the next ones.

A step whose sequences carry drafts (``Sequence.draft_token_ids``, scheduled behind their last token) runs here
instead of the plain forward + sampler:

1. the target forward over the whole packed batch (prefill chunks of other requests included) through the
   drafter, which keeps what it reads of the target (V4: the residual streams; V4.1: the captured target-layer
   hiddens); verify spans record their compressor updates and are snapshotted first;
2. each sampled sequence's rows are judged in order (:func:`verify_sequence`): penalties, ``min_tokens`` and
   the grammar applied as if the earlier drafts were already part of the output; greedy rows accept drafts
   equal to the argmax, sampled rows use rejection sampling (:mod:`dsinfer.spec.rejection`) with randomness
   from the request's own generator (seeded replay, batch invariance); sequences without drafts go through
   the plain :class:`~dsinfer.engine.sampler.Sampler` and draw exactly what plain decoding draws;
3. the cache writes of rejected positions are undone (:mod:`dsinfer.spec.rollback`);
4. the drafter reads every kept position and drafts the next tokens: V4's MTP layer (:mod:`dsinfer.spec.mtp`,
   ``method: mtp``) or V4.1's DSpark stages (:mod:`dsinfer.spec.dspark`, ``method: dspark``).

The engine then appends the emitted tokens one at a time (stop rules inside an accepted run cut it there).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from dsinfer.config import SpeculativeConfig
from dsinfer.engine.sampler import (
    SampleOutput,
    Sampler,
    SamplingState,
    _outputs,
    apply_penalties,
    exponential_noise,
    filtered_probs,
    suppress_stop_tokens,
)
from dsinfer.kv.batch import SequenceSpan
from dsinfer.models.deepseek_v41 import DeepseekV41
from dsinfer.spec.drafting import Drafter, DraftInput
from dsinfer.spec.dspark import DSparkDrafter
from dsinfer.spec.mtp import MTPDrafter
from dsinfer.spec.rejection import final_distribution, greedy_accept, num_accepted
from dsinfer.spec.rollback import CacheRollback

if TYPE_CHECKING:
    from dsinfer.engine.model_runner import ModelRunner


@dataclass
class SpeculationPlan:
    """Per span of a step: its drafts (the last ``len`` rows), and the token after it when it is not sampled."""

    drafts: list[list[int]]
    following_token: list[int | None]  # prompt token after a prefill chunk; None for a sampled span
    token_ids: list[int]  # the step's input ids on the host (the drafter's inputs are built from them)


@dataclass
class SpeculativeOutput(SampleOutput):
    """A sampled sequence's verified tokens: ``token_ids`` are the accepted drafts then one more token."""

    num_drafts: int = 0
    num_accepted: int = 0
    next_drafts: list[int] = field(default_factory=list)


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

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verify round: 1 + accepted drafts per round (tau)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


def verify_sequence(logits: torch.Tensor, drafts: list[int], state: SamplingState) -> tuple[list[int], int]:
    """Judge ``drafts`` against the target's ``logits`` [len(drafts) + 1, V] of one sequence.

    Returns the emitted tokens (accepted drafts, then the correction or bonus token) and how many drafts were
    accepted. A grammar's state is advanced through the drafts it allows and rolled back before returning.
    """
    scores = logits.float().clone()
    constraint = state.constraint
    allowed = 0  # leading drafts the grammar allows (every draft without a grammar)
    for row in range(len(drafts) + 1):
        view = replace(state, output_token_ids=state.output_token_ids + drafts[:row])
        apply_penalties(scores[row : row + 1], [view])
        suppress_stop_tokens(scores[row : row + 1], [view])
        if constraint is not None:
            constraint.fill_mask(scores[row])
        if row == len(drafts) or not torch.isfinite(scores[row, drafts[row]]):
            break
        if constraint is not None:
            constraint.accept(drafts[row])
        allowed += 1
    if constraint is not None and allowed:
        constraint.rollback(allowed)
    rows = allowed + 1
    draft_ids = torch.tensor(drafts[:allowed], dtype=torch.long, device=scores.device)
    if state.params.greedy:
        target = scores[:rows].argmax(dim=-1)
        accepted = greedy_accept(target, draft_ids)
        return drafts[:accepted] + [int(target[accepted])], accepted
    probs = filtered_probs(scores[:rows], [state.params] * rows)[None]
    uniforms = torch.rand(1, allowed, generator=state.generator).to(scores.device)
    accepted = int(num_accepted(probs, draft_ids[None], uniforms)[0])
    row = final_distribution(probs, draft_ids[None], torch.tensor([accepted], device=scores.device))
    noise = exponential_noise([state.generator], row.shape[-1]).to(scores.device)
    return drafts[:accepted] + [int((row / noise).argmax(-1)[0])], accepted


def _speculative_output(logits: torch.Tensor, tokens: list[int], drafts: list[int], state) -> SpeculativeOutput:
    """Logprobs of every emitted token (each from its own row's raw logits), as one output."""
    views = [replace(state, output_token_ids=state.output_token_ids + drafts[:row]) for row in range(len(tokens))]
    rows = _outputs(logits[: len(tokens)], tokens, views)
    wants = state.params.logprobs is not None
    return SpeculativeOutput(
        token_ids=tokens,
        logprobs=[r.logprobs[0] for r in rows] if wants else None,
        top_logprobs=[r.top_logprobs[0] for r in rows] if rows[0].top_logprobs is not None else None,
        num_drafts=len(drafts),
        num_accepted=len(tokens) - 1,
    )


def build_drafter(model, cache, config: SpeculativeConfig) -> Drafter:
    """The drafter of ``config.method`` over the engine cache (the checkpoint was checked to support it)."""
    if config.method == "dspark":
        return DSparkDrafter(model, cache, config.num_speculative_tokens, config.confidence_threshold)
    return MTPDrafter(model, cache, config.num_speculative_tokens)


class SpeculativeExecutor:
    """Runs steps that verify drafts and draft again, on the device worker (see the module docstring)."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, config: SpeculativeConfig) -> None:
        self.runner, self.model, self.cache, self.sampler = runner, runner.model, runner.cache, sampler
        self.drafter = build_drafter(self.model, self.cache, config)
        hasher = self.model.engram_hasher if isinstance(self.model, DeepseekV41) else None
        self.rollback = CacheRollback(self.cache, self.model.config.num_hidden_layers, hasher)

    def run(self, step, states: list[SamplingState]) -> list[SpeculativeOutput]:
        """Forward, judge, roll back, draft (the judging runs outside inference mode, as the plain sampler does:
        its noise is filled on a thread pool)."""
        plan: SpeculationPlan = step.speculation
        with torch.inference_mode():
            batch = self.runner.step_batch(step)  # Engram history restored first: the snapshots see it
            snapshots, offset = {}, 0
            for index, (span, drafts) in enumerate(zip(step.spans, plan.drafts, strict=True)):
                if drafts:
                    tokens = step.input_ids[offset : offset + span.length]
                    snapshots[index] = self.rollback.snapshot(span, tokens)
                    span.journal = []
                offset += span.length
            logits, target_hidden = self.drafter.target_forward(batch, step.sample_rows)
        outputs = self._judge(logits, plan, states)
        with torch.inference_mode():
            self._roll_back_and_draft(step, target_hidden, plan, outputs, snapshots)
        return outputs

    def _roll_back_and_draft(self, step, target_hidden, plan: SpeculationPlan, outputs, snapshots) -> None:
        """Undo the rejected positions' cache writes, then draft from the kept positions."""
        sampled = [i for i, token in enumerate(plan.following_token) if token is None]
        kept = [span.length for span in step.spans]
        for index, output in zip(sampled, outputs, strict=True):
            span = step.spans[index]
            kept[index] = span.length - len(plan.drafts[index]) + output.num_accepted
            if index in snapshots:
                self.rollback.rollback(snapshots[index], span.journal, kept[index])
                span.journal = None
        next_drafts = self.drafter.draft(self._draft_input(step, target_hidden, plan, outputs, sampled, kept))
        for output, drafts in zip(outputs, next_drafts, strict=True):
            output.next_drafts = drafts

    def _judge(self, logits: torch.Tensor, plan: SpeculationPlan, states: list[SamplingState]):
        """One output per sampled sequence: plain sampling without drafts, verification with them."""
        drafts = [d for d, token in zip(plan.drafts, plan.following_token, strict=True) if token is None]
        plain = [i for i, d in enumerate(drafts) if not d]
        row_of, row = [], 0
        for d in drafts:
            row_of.append(row)
            row += len(d) + 1
        outputs: list[SpeculativeOutput | None] = [None] * len(states)
        if plain:
            index = torch.tensor([row_of[i] for i in plain], device=logits.device)
            for i, out in zip(plain, self.sampler(logits.index_select(0, index), [states[i] for i in plain]),
                              strict=True):  # fmt: skip
                outputs[i] = SpeculativeOutput(out.token_ids, out.logprobs, out.top_logprobs)
        for i, d in enumerate(drafts):
            if d:
                rows = logits[row_of[i] : row_of[i] + len(d) + 1]
                tokens, _ = verify_sequence(rows, d, states[i])
                outputs[i] = _speculative_output(rows, tokens, d, states[i])
        return outputs

    def _draft_input(self, step, target_hidden, plan, outputs, sampled, kept) -> DraftInput:
        """The kept positions of every span, each with the token after it, for the drafter."""
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
            if index in emitted:
                drafting.append(len(spans))
            spans.append(SequenceSpan(span.start, count, span.slot, span.block_table, span.reuse_below,
                                      span.window_from))  # fmt: skip
            offset += span.length
        device = target_hidden.device
        return DraftInput(
            target_hidden[torch.tensor(rows, device=device)],
            torch.tensor(next_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            spans,
            drafting,
        )
