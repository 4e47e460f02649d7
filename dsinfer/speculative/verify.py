"""Judging a speculative step: every sampled sequence's verified tokens, batched over the step.

A sequence's rows (its last token's, then one per draft) are judged as if the earlier drafts were already part
of its output. Most sequences need nothing from the host between their rows, so they are judged together in
one device computation (:func:`judge_batched`): ``min_tokens`` masks known from the host's lengths, greedy rows
matched against the argmax, sampled rows through :func:`~dsinfer.speculative.rejection.accept_argmax_drafts` with
counter-based uniforms and noise keyed by each request's seed and output position (seeded replay, batch
invariance; the correction or bonus token gets the noise plain decoding draws at its position), logprobs of the
emitted tokens; the whole step's result then comes to the host in one read. Sequences with a grammar or
penalties take their own pass (:func:`verify_sequence`): the grammar's mask at a row depends on the drafts
before it, and penalties count them; without drafts those go through the plain sampler.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from dsinfer.kv.batch import host_to_device
from dsinfer.sampling.noise import exponentials, key_tensor
from dsinfer.sampling.sampler import (
    SampleOutput,
    SamplingState,
    _outputs,
    accept_uniforms,
    apply_penalties,
    filtered_probs,
    race_at,
    suppress_stop_tokens,
)
from dsinfer.speculative.rejection import accept_argmax_drafts, final_distribution, greedy_accept, num_accepted


@dataclass
class SpeculativeOutput(SampleOutput):
    """A sampled sequence's verified tokens: ``token_ids`` are the accepted drafts then one more token."""

    num_drafts: int = 0
    num_accepted: int = 0
    next_drafts: list[int] = field(default_factory=list)


def needs_own_pass(state: SamplingState) -> bool:
    """Whether a sequence's rows must be judged one after the other on the host: a grammar, or penalties."""
    params = state.params
    return (
        state.constraint is not None
        or params.repetition_penalty != 1.0
        or bool(params.presence_penalty)
        or bool(params.frequency_penalty)
    )


def judge_greedy_fixed(
    logits: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy judging of a fixed-width step on the device, no host read: ``logits`` [B * width, V] (sequence after
    sequence), ``draft_ids`` [B, width - 1], ``num_drafts`` [B] (the drafts past it are filler, never accepted).
    Returns ``(accepted [B], last [B])``: the leading drafts equal to the argmax, then the argmax after them
    (lowest id on ties, as plain decoding)."""
    count, width = draft_ids.shape[0], draft_ids.shape[1] + 1
    return accept_targets(logits.view(count, width, -1).argmax(dim=-1), draft_ids, num_drafts)


def accept_targets(
    target: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leading drafts equal to the target ids [B, width] (up to ``num_drafts``), and the target after them."""
    valid = torch.arange(draft_ids.shape[1], device=target.device)[None, :] < num_drafts[:, None]
    accepted = ((target[:, :-1] == draft_ids) & valid).long().cumprod(-1).sum(-1)
    return accepted, target.gather(1, accepted[:, None])[:, 0]


def allowed_drafts(drafts: list[int], state: SamplingState, vocab_size: int) -> int:
    """Leading drafts that ``min_tokens`` lets through (a batched row has no other mask): a stop token is
    masked while the output, with the drafts before it, is shorter than ``min_tokens``."""
    produced, floor = len(state.output_token_ids), state.params.min_tokens
    for index, token in enumerate(drafts):
        if produced + index < floor and token in state.stop_token_ids and token < vocab_size:
            return index
    return len(drafts)


def judge_batched(
    logits: torch.Tensor,
    first_rows: list[int],
    drafts: list[list[int]],
    states: list[SamplingState],
) -> list[SpeculativeOutput]:
    """Judge sequences without a grammar or penalties all at once; one host read for all of them.

    Sequence ``b``'s rows are ``logits[first_rows[b] : first_rows[b] + len(drafts[b]) + 1]`` (its last token's,
    then its drafts'); a sequence without drafts draws exactly what the plain sampler draws.
    """
    device, vocab = logits.device, logits.shape[-1]
    counts = [allowed_drafts(d, s, vocab) for d, s in zip(drafts, states, strict=True)]
    width = max(counts) + 1  # rows per sequence: padded with its last row
    index = [first + min(j, n) for first, n in zip(first_rows, counts, strict=True) for j in range(width)]
    raw = logits.index_select(0, host_to_device(index, torch.long, device))  # [B * width, V]
    scores = _mask_stop_tokens(raw.float(), counts, states, width)
    padded = [d[:n] + [0] * (width - 1 - n) for d, n in zip(drafts, counts, strict=True)]
    draft_ids = host_to_device(padded, torch.long, device).view(len(drafts), width - 1)
    num_drafts = host_to_device(counts, torch.long, device)
    target = scores.view(len(drafts), width, vocab).argmax(dim=-1)  # lowest id on ties, as plain decoding
    accepted, last = accept_targets(target, draft_ids, num_drafts)
    sampled = [b for b, state in enumerate(states) if not state.params.greedy]
    if sampled:
        rows = host_to_device(sampled, torch.long, device)
        params = [states[b].params for b in sampled for _ in range(width)]
        probs = filtered_probs(scores.view(len(drafts), width, vocab)[rows].flatten(0, 1), params)
        uniforms, noise = _randomness([states[b] for b in sampled], [counts[b] for b in sampled], width, vocab, device)
        drawn, drawn_last = accept_argmax_drafts(probs.view(len(sampled), width, vocab), draft_ids[rows],
                                                 num_drafts[rows], uniforms, noise)  # fmt: skip
        accepted, last = accepted.index_put((rows,), drawn), last.index_put((rows,), drawn_last)
    emitted = torch.where(torch.arange(width, device=device)[None, :] < accepted[:, None],
                          torch.cat([draft_ids, last[:, None]], dim=1), last[:, None])  # fmt: skip
    wanted = [b for b, state in enumerate(states) if state.params.logprobs is not None]
    pieces, most = [accepted, last], 0
    if wanted:
        rows = host_to_device(wanted, torch.long, device)
        logprobs = raw.view(len(drafts), width, vocab)[rows].float().log_softmax(dim=-1)
        most = min(max(states[b].params.logprobs for b in wanted), vocab)
        top_values, top_ids = logprobs.topk(most, dim=-1)  # sorted, most likely first
        pieces += [logprobs.gather(-1, emitted[rows][..., None]), top_ids, top_values]
    values = torch.cat([piece.double().flatten() for piece in pieces]).tolist()  # the step's one host read
    return _unpack(values, drafts, states, wanted, width, most)


def _mask_stop_tokens(scores: torch.Tensor, counts: list[int], states: list[SamplingState], width: int):
    """``min_tokens``: mask the stop tokens of every row whose output, drafts before it included, is shorter."""
    vocab = scores.shape[-1]
    rows, columns = [], []
    for b, (n, state) in enumerate(zip(counts, states, strict=True)):
        blocked = [t for t in state.stop_token_ids if t < vocab]
        for j in range(width):
            if blocked and len(state.output_token_ids) + min(j, n) < state.params.min_tokens:
                rows += [b * width + j] * len(blocked)
                columns += blocked
    if not rows:
        return scores
    device = scores.device
    index = (host_to_device(rows, torch.long, device), host_to_device(columns, torch.long, device))
    return scores.index_put(index, scores.new_full((), float("-inf")))


def _randomness(states: list[SamplingState], counts: list[int], width: int, vocab: int, device):
    """Each sampled sequence's accept uniforms (one per draft, keyed by the draft's output position) and its
    race noise at each of the ``width`` output positions its last token may land on ([S, width, V])."""
    uniforms = torch.ones(len(states), width - 1, device=device)
    for row, (state, n) in enumerate(zip(states, counts, strict=True)):
        if n:
            uniforms[row, :n] = accept_uniforms(state, n, device)
    keys = [state.noise_key(len(state.output_token_ids) + j) for state in states for j in range(width)]
    noise = exponentials(key_tensor(keys, device), vocab).view(len(states), width, vocab)
    return uniforms, noise


def _unpack(values: list[float], drafts, states, wanted: list[int], width: int, most: int):
    """The host's outputs from the step's one read: accepted counts, last tokens, then the logprob pieces."""
    count = len(drafts)
    accepted, last = values[:count], values[count : 2 * count]
    chosen_at, ids_at = 2 * count, 2 * count + len(wanted) * width
    values_at = ids_at + len(wanted) * width * most
    position = {b: w for w, b in enumerate(wanted)}
    outputs = []
    for b, (d, state) in enumerate(zip(drafts, states, strict=True)):
        taken = int(accepted[b])
        output = SpeculativeOutput(d[:taken] + [int(last[b])], None, None, len(d), taken)
        if state.params.logprobs is not None:
            w, n = position[b], state.params.logprobs
            output.logprobs = values[chosen_at + w * width : chosen_at + w * width + taken + 1]
            output.top_logprobs = []
            for j in range(taken + 1):
                at = (w * width + j) * most
                ids, top = values[ids_at + at : ids_at + at + n], values[values_at + at : values_at + at + n]
                output.top_logprobs.append([(int(i), v) for i, v in zip(ids, top, strict=True)])
        outputs.append(output)
    return outputs


def verify_sequence(logits: torch.Tensor, drafts: list[int], state: SamplingState) -> tuple[list[int], int]:
    """Judge ``drafts`` against the target's ``logits`` [len(drafts) + 1, V] of one sequence, on its own.

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
    uniforms = accept_uniforms(state, allowed, scores.device)[None]
    accepted = int(num_accepted(probs, draft_ids[None], uniforms)[0])
    row = final_distribution(probs, draft_ids[None], torch.tensor([accepted], device=scores.device))
    return drafts[:accepted] + [int(race_at(row, state, len(state.output_token_ids) + accepted)[0])], accepted


def speculative_output(logits: torch.Tensor, tokens: list[int], drafts: list[int], state) -> SpeculativeOutput:
    """Logprobs of every emitted token of one sequence judged on its own (each from its own row's raw logits)."""
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
