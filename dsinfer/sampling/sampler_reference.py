"""The sampler's row-by-row steps as they were before batching: the reference the batched ones must equal.

Each function handles one request at a time with plain indexing, exactly as :mod:`dsinfer.sampling.sampler` did
when it drew its noise from per-request CPU generators. The tests compare the batched device ops against these
on random inputs, and ``benchmarks/sampler_step.py`` times :func:`sample_row_by_row` (the whole former step)
against the batched sampler.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch


def apply_penalties(scores: torch.Tensor, states) -> torch.Tensor:
    """Repetition on prompt + output, presence and frequency on output; in place, row by row."""
    for row, state in enumerate(states):
        params = state.params
        if params.repetition_penalty != 1.0 and (state.prompt_token_ids or state.output_token_ids):
            seen = torch.tensor(state.prompt_token_ids + state.output_token_ids, device=scores.device).unique()
            values = scores[row, seen]
            penalty = params.repetition_penalty
            scores[row, seen] = torch.where(values > 0, values / penalty, values * penalty)
        if (params.presence_penalty or params.frequency_penalty) and state.output_token_ids:
            generated, counts = torch.tensor(state.output_token_ids).unique(return_counts=True)
            deduction = params.frequency_penalty * counts.float() + params.presence_penalty
            scores[row, generated.to(scores.device)] -= deduction.to(scores.device)
    return scores


def suppress_stop_tokens(scores: torch.Tensor, states) -> torch.Tensor:
    """Stop ids below the vocabulary set to -inf while the output is shorter than min_tokens; row by row."""
    vocab_size = scores.shape[-1]
    for row, state in enumerate(states):
        if state.constraint is not None and state.constraint.is_completed():
            continue
        if len(state.output_token_ids) < state.params.min_tokens:
            blocked = [token_id for token_id in state.stop_token_ids if token_id < vocab_size]
            if blocked:
                scores[row, torch.tensor(blocked, device=scores.device)] = float("-inf")
    return scores


def apply_constraints(scores: torch.Tensor, states) -> torch.Tensor:
    """Each constrained row masked by its own grammar, one row at a time."""
    for row, state in enumerate(states):
        if state.constraint is not None:
            state.constraint.fill_mask(scores[row])
    return scores


def logprobs(raw_logits: torch.Tensor, token_ids: list[int], states):
    """Per row: the chosen token's logprob and the top-n (id, logprob) pairs, or None when not asked for."""
    result = []
    for row, state in enumerate(states):
        count = state.params.logprobs
        if count is None:
            result.append(None)
            continue
        row_logprobs = raw_logits[row].float().log_softmax(dim=-1)
        values, ids = row_logprobs.topk(min(count, raw_logits.shape[-1]))
        result.append((row_logprobs[token_ids[row]].item(), list(zip(ids.tolist(), values.tolist(), strict=True))))
    return result


def sample_row_by_row(logits: torch.Tensor, states, pool: ThreadPoolExecutor | None = None) -> list[int]:
    """The former sampler step: row-by-row penalties and masks, then greedy or a race on CPU-generator noise.

    ``pool`` draws the rows' noise on threads, as the former sampler did. Returns the chosen ids; logprobs are
    :func:`logprobs`.
    """
    from dsinfer.sampling.sampler import exponential_noise, filtered_probs

    scores = logits.float().clone()
    apply_penalties(scores, states)
    suppress_stop_tokens(scores, states)
    apply_constraints(scores, states)
    token_ids = scores.argmax(dim=-1)
    sampled_rows = [row for row, state in enumerate(states) if not state.params.greedy]
    if sampled_rows:
        index = torch.tensor(sampled_rows, device=scores.device)
        sampled_states = [states[row] for row in sampled_rows]
        probs = filtered_probs(scores.index_select(0, index), [state.params for state in sampled_states])
        generators = [state.generator for state in sampled_states]
        noise = exponential_noise(generators, scores.shape[-1], pool, pin_memory=scores.is_cuda)
        token_ids[index] = (probs / noise.to(scores.device, non_blocking=True)).argmax(dim=-1)
    return token_ids.tolist()
