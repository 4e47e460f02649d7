"""Judging a fixed-width verify step on the device, sampled sequences included, with no host read.

A graphed verify step (:mod:`dsinfer.speculative.graphs`) judges greedy sequences inside its verify graph
(:func:`~dsinfer.speculative.verify.judge_greedy_fixed`: the argmax of the raw logits). When a sequence samples
(temperature, top-k, top-p, min-p; seeded or not) or has its stop tokens masked by ``min_tokens``, a small judge
graph replays after the verify graph and computes what the host's batched judge
(:func:`~dsinfer.speculative.verify.judge_batched`) computes, from per-sequence parameters in input tensors that
the host fills once a step (:class:`FixedJudge`):

* ``min_tokens``: each sequence's stop ids (at most :data:`STOP_SLOTS`) masked in the rows whose output position
  (the planned one plus the row) is below ``min_tokens``; greedy rows then take the argmax of the masked scores;
* every row's filtered probabilities (:func:`~dsinfer.sampling.sampler.filter_probs`, one temperature, top-k,
  top-p and min-p per sequence), then rejection sampling of the argmax drafts
  (:mod:`dsinfer.speculative.rejection`);
* the accept uniforms and the race noise keyed on the device: the host sends each request's stream keys
  (:func:`~dsinfer.sampling.noise.stream_key`) and planned output position, the device folds in the position of
  each draft and of the token after the accepted ones (:func:`~dsinfer.sampling.noise.position_keys`). These are
  the host judge's keys, so seeded requests get the host judge's tokens, bit for bit.

The filter's sort runs only in the judge graph of steps with a top-k or top-p request (:attr:`JudgeMode`).
Grammars, penalties and logprobs stay with the host judge (:func:`judged_on_device`).
"""

from __future__ import annotations

from enum import Enum

import torch

from dsinfer.kv.batch import host_into_device
from dsinfer.sampling.noise import ACCEPT_STREAM, RACE_STREAM, as_int64, position_keys, race, stream_key, uniforms
from dsinfer.sampling.sampler import SamplingState, filter_probs, masks_stop_tokens
from dsinfer.speculative.rejection import accepted_argmax_drafts, argmax_drafts_final
from dsinfer.speculative.verify import accept_targets, needs_own_pass

STOP_SLOTS = 8  # stop ids a sequence under min_tokens may have for the device to mask them
# One sequence's integer inputs: sampled | output position | rows masked | race key | accept key | stop ids.
_SAMPLED, _POSITION, _MASKED, _RACE_KEY, _ACCEPT_KEY, _STOPS = range(6)
_NEUTRAL = [1.0, 0.0, 1.0, 0.0]  # temperature, top-k, top-p, min-p that change nothing


class JudgeMode(Enum):
    """How a graphed step is judged: each mode but ``ARGMAX`` is one judge graph per bucket."""

    ARGMAX = "argmax"  # greedy sequences, nothing masked: the verify graph's own judge
    FILTERED = "filtered"  # stop tokens masked, sampled rows filtered by temperature and min-p
    FILTERED_TOP = "filtered_top"  # also top-k / top-p (a sort over the vocabulary per row)


def judged_on_device(state: SamplingState) -> bool:
    """Whether a graphed step's device judge decides this sequence: no grammar or penalties (the host judges
    their rows one after the other), no logprobs, and few enough stop ids while ``min_tokens`` masks them."""
    if state.params.logprobs is not None or needs_own_pass(state):
        return False
    return not masks_stop_tokens(state) or len(state.stop_token_ids) <= STOP_SLOTS


class FixedJudge:
    """The judge graphs' input tensors (one row per sequence of the largest bucket) and the judge itself."""

    def __init__(self, largest: int, device: torch.device) -> None:
        self.values = torch.tensor([_NEUTRAL] * largest, dtype=torch.float32, device=device)
        self.rows = torch.zeros(largest, _STOPS + STOP_SLOTS, dtype=torch.long, device=device)

    def plan(self, states: list[SamplingState], size: int, width: int) -> JudgeMode | None:
        """The mode that judges ``states`` (a bucket of ``size`` rows, ``width`` positions each) on the device,
        its inputs filled (two copies from the host); None when some sequence needs the host judge."""
        if not all(judged_on_device(state) for state in states):
            return None
        sampled = [not state.params.greedy for state in states]
        if not any(sampled) and not any(masks_stop_tokens(state) for state in states):
            return JudgeMode.ARGMAX
        values, rows = [], []
        for state, sampling in zip(states, sampled, strict=True):
            params, position = state.params, len(state.output_token_ids)
            masked = min(max(params.min_tokens - position, 0), width) if state.stop_token_ids else 0
            stops = sorted(state.stop_token_ids)[:STOP_SLOTS] if masked else []
            keys = [as_int64(stream_key(state.seed, state.sample_index, s)) for s in (RACE_STREAM, ACCEPT_STREAM)]
            rows += [int(sampling), position, masked, *keys, *stops] + [-1] * (STOP_SLOTS - len(stops))
            values += [params.temperature, params.top_k, params.top_p, params.min_p] if sampling else _NEUTRAL
        padding = size - len(states)
        host_into_device(self.rows[:size], rows + [0] * (padding * self.rows.shape[1]))
        host_into_device(self.values[:size], values + _NEUTRAL * padding)
        uses_top = any(s and (state.params.top_k > 0 or state.params.top_p < 1.0)
                       for s, state in zip(sampled, states, strict=True))  # fmt: skip
        return JudgeMode.FILTERED_TOP if uses_top else JudgeMode.FILTERED

    def judge(self, logits: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor, mode: JudgeMode):
        """``(accepted [B], last [B])`` of a bucket's ``B`` sequences from ``logits`` [B * width, V] (sequence
        after sequence), ``draft_ids`` [B, width - 1] and ``num_drafts`` [B] (drafts past it are filler), for
        :meth:`plan`'s inputs; no host read."""
        count, width = draft_ids.shape[0], draft_ids.shape[1] + 1
        rows = self.rows[:count]
        scores = self._mask_stop_tokens(logits.float().view(count, width, -1), rows)
        accepted, last = accept_targets(scores.argmax(dim=-1), draft_ids, num_drafts)  # greedy rows
        drawn, drawn_last = self._sample(scores, draft_ids, num_drafts, mode)
        sampled = rows[:, _SAMPLED] != 0
        return torch.where(sampled, drawn, accepted), torch.where(sampled, drawn_last, last)

    @staticmethod
    def _mask_stop_tokens(scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``min_tokens``: stop ids below the vocabulary at -inf in each sequence's first ``masked`` rows."""
        count, width, vocab = scores.shape
        stops = rows[:, _STOPS:]
        stops = torch.where((stops >= 0) & (stops < vocab), stops, vocab)  # unused slots: a column cut off below
        blocked = torch.zeros(count, vocab + 1, dtype=torch.bool, device=scores.device).scatter_(1, stops, True)
        masked = torch.arange(width, device=scores.device)[None, :] < rows[:, _MASKED, None]
        return scores.masked_fill(masked[:, :, None] & blocked[:, None, :vocab], float("-inf"))

    def _sample(self, scores: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor, mode: JudgeMode):
        """Rejection sampling of every sequence as if it sampled (greedy rows' results are dropped)."""
        count, width, vocab = scores.shape
        rows, values = self.rows[:count], self.values[:count]
        per_row = [values[:, column, None].expand(count, width).reshape(-1) for column in range(4)]
        probs = filter_probs(scores.flatten(0, 1), *per_row, use_top=mode is JudgeMode.FILTERED_TOP)
        probs = probs.view(count, width, vocab)
        positions = rows[:, _POSITION]
        draft_positions = positions[:, None] + torch.arange(width - 1, device=scores.device)[None, :]
        accept_keys = position_keys(rows[:, _ACCEPT_KEY, None], draft_positions)
        accept_uniforms = uniforms(accept_keys.flatten(), 1).view(count, width - 1)
        accepted = accepted_argmax_drafts(probs, draft_ids, num_drafts, accept_uniforms)
        final = argmax_drafts_final(probs, draft_ids, num_drafts, accepted)
        return accepted, race(final, position_keys(rows[:, _RACE_KEY], positions + accepted))
