"""The sampler: turn one row of next-token logits per request into one token per request.

Each row goes through, in this order: penalties (repetition on prompt + output tokens, presence and
frequency on output tokens) -> stop tokens masked while the output is shorter than ``min_tokens`` ->
the structured-output grammar's mask, for rows that have one -> greedy argmax, or temperature -> top-k ->
top-p -> min-p -> an exponential race.

Batch invariance is the design constraint. A request's token depends only on its own logits, its own
generator and how many tokens it has drawn, never on which row it sits in or what else is in the batch:
the noise is drawn per request from its own ``torch.Generator`` on the CPU (so CUDA and CPU runs draw the
same numbers), and every other step works row by row. A seeded request therefore replays exactly.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsinfer.sampling_params import SamplingParams

if TYPE_CHECKING:  # importing xgrammar costs seconds; only requests with structured output need it
    from dsinfer.engine.structured_output import GrammarConstraint

_SEED_MODULUS = 2**64  # torch.Generator.manual_seed takes 64-bit seeds; wider or negative seeds wrap


@dataclass
class SamplingState:
    """What the sampler needs to know about one request; owned by the engine's sequence, never mutated here."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the engine appends each token it accepts
    stop_token_ids: frozenset[int]  # eos (unless ignore_eos) and params.stop_token_ids
    generator: torch.Generator  # CPU generator owned by this request alone
    constraint: GrammarConstraint | None = None  # structured output; the engine advances it, we only read it


@dataclass
class SampleOutput:
    """One request's result for one step; lists run over the tokens produced (one per step today)."""

    token_ids: list[int]
    logprobs: list[float] | None  # chosen token's logprob under the raw model logits, when requested
    top_logprobs: list[list[tuple[int, float]]] | None  # top-n (token id, logprob), most likely first


def make_sampling_state(
    params: SamplingParams,
    prompt_token_ids: Iterable[int],
    eos_token_id: int | None,
    *,
    sample_index: int = 0,
    constraint: GrammarConstraint | None = None,
) -> SamplingState:
    """Build a request's state: its stop ids and its own generator.

    ``sample_index`` tells apart the ``n`` completions of one seeded request: completion ``i`` is seeded with
    ``seed + i``, so they differ from each other yet each replays exactly. Unseeded requests draw a fresh
    seed from the operating system, so no two requests share a random stream. ``constraint`` is this
    completion's own structured-output grammar state (never shared between completions).
    """
    stop_token_ids = set(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        stop_token_ids.add(eos_token_id)
    seed = secrets.randbits(63) if params.seed is None else params.seed + sample_index
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed % _SEED_MODULUS)
    return SamplingState(params, list(prompt_token_ids), [], frozenset(stop_token_ids), generator, constraint)


class Sampler:
    """Choose the next token of every request in a batch.

    ``Sampler()(logits, states)`` takes ``logits`` of shape ``[B, V]`` (any float dtype, any device; row ``i``
    belongs to ``states[i]``) and returns one :class:`SampleOutput` per state, in the same order. Neither the
    logits nor the states are modified.

    Logprobs are the ``log_softmax`` of the raw model logits, before penalties, ``min_tokens`` masking and
    temperature, as vLLM reports them by default: they describe what the model believes, not the filtered
    distribution the token was drawn from.

    ``noise_threads`` CPU threads draw the per-request noise side by side: one generator fills 129k floats in
    about 1 ms, so a 256-request batch would otherwise spend ~250 ms a step there (H200 host, measured).
    """

    def __init__(self, noise_threads: int = 8) -> None:
        self._noise_pool = ThreadPoolExecutor(noise_threads, "sampler-noise") if noise_threads > 1 else None

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> list[SampleOutput]:
        """Sample one token per row; see the class docstring for the contract."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [len(states)={len(states)}, vocab], got {tuple(logits.shape)}")
        if not states:
            return []
        scores = logits.float().clone()
        apply_penalties(scores, states)
        suppress_stop_tokens(scores, states)
        apply_constraints(scores, states)
        token_ids = choose_tokens(scores, states, self._noise_pool)
        return _outputs(logits, token_ids, states)


def apply_penalties(scores: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Apply each row's repetition, presence and frequency penalties to ``scores`` in place; returns it.

    Repetition (HF / vLLM): every token seen in prompt or output has a positive logit divided by the
    penalty and a negative one multiplied by it. Presence and frequency (OpenAI): a token generated
    ``c`` times loses ``frequency_penalty * c + presence_penalty * (c > 0)``; the prompt does not count.
    """
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


def suppress_stop_tokens(scores: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Mask the stop token ids of rows whose output is still shorter than ``min_tokens``; in place, returns it.

    Ids beyond the vocabulary are ignored: ``stop_token_ids`` come from the user, who cannot know our vocab.
    A row whose structured-output grammar is complete is left alone: the grammar's end wins over
    ``min_tokens``, since masking eos there could leave no token at all.
    """
    vocab_size = scores.shape[-1]
    for row, state in enumerate(states):
        if state.constraint is not None and state.constraint.is_completed():
            continue
        if len(state.output_token_ids) < state.params.min_tokens:
            blocked = [token_id for token_id in state.stop_token_ids if token_id < vocab_size]
            if blocked:
                scores[row, torch.tensor(blocked, device=scores.device)] = float("-inf")
    return scores


def apply_constraints(scores: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Mask, in place, the tokens each constrained row's grammar forbids next; returns ``scores``."""
    for row, state in enumerate(states):
        if state.constraint is not None:
            state.constraint.fill_mask(scores[row])
    return scores


def choose_tokens(
    scores: torch.Tensor, states: list[SamplingState], noise_pool: ThreadPoolExecutor | None = None
) -> list[int]:
    """Greedy rows take the argmax (lowest id on ties); the others race on their filtered probabilities."""
    token_ids = scores.argmax(dim=-1)  # torch.argmax returns the first maximum: the lowest id wins ties
    sampled_rows = [row for row, state in enumerate(states) if not state.params.greedy]
    if sampled_rows:
        index = torch.tensor(sampled_rows, device=scores.device)
        sampled_states = [states[row] for row in sampled_rows]
        probs = filtered_probs(scores.index_select(0, index), [state.params for state in sampled_states])
        generators = [state.generator for state in sampled_states]
        noise = exponential_noise(generators, scores.shape[-1], noise_pool, pin_memory=scores.is_cuda)
        token_ids[index] = (probs / noise.to(scores.device, non_blocking=True)).argmax(dim=-1)
    return token_ids.tolist()


def filtered_probs(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, batched with one parameter per row.

    The result is unnormalised after min-p (tokens below the cut are zeroed, the rest keep their mass):
    the exponential race picks token ``i`` with probability ``p_i / sum(p)``, so scaling does not matter.
    """
    device = scores.device
    temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    scores = scores / temperatures[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        scores = _mask_top_k_top_p(scores, top_k, top_p)
    probs = scores.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        cut = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < cut, 0.0)
    return probs


def _mask_top_k_top_p(scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every token outside the top k (k <= 0: no limit), then outside the nucleus.

    The nucleus is the smallest most-likely-first set whose probability (renormalised after top-k) reaches
    ``top_p``: a token stays when the mass strictly before it is below ``top_p``, so the first always stays.
    A stable sort keeps the lowest id first among equal logits, so the cut is deterministic.
    """
    vocab_size = scores.shape[-1]
    sorted_scores, sorted_ids = scores.sort(dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab_size, device=scores.device)
    k = torch.where(top_k > 0, top_k, vocab_size)
    sorted_scores = sorted_scores.masked_fill(positions[None, :] >= k[:, None], float("-inf"))
    sorted_probs = sorted_scores.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_scores = sorted_scores.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(scores, float("-inf")).scatter(-1, sorted_ids, sorted_scores)


def exponential_noise(
    generators: list[torch.Generator],
    vocab_size: int,
    pool: ThreadPoolExecutor | None = None,
    pin_memory: bool = False,
) -> torch.Tensor:
    """One row of Exp(1) noise per generator, drawn on the CPU so every device sees the same numbers.

    Drawn as ``-log(U)`` from ``torch.rand``, several times faster on CPU than ``Tensor.exponential_``.
    ``U == 0`` gives ``inf``, which only drops that token from this one race (``p / inf == 0``) and never
    produces NaN, unlike a zero noise value divided into a masked zero probability. Each row is filled by
    its own generator alone, so spreading rows over ``pool`` threads changes no value. Pinned memory lets
    the copy to a GPU run without a staging pass.
    """
    noise = torch.empty(len(generators), vocab_size, pin_memory=pin_memory)

    def fill(row: int) -> None:
        torch.rand(vocab_size, generator=generators[row], out=noise[row])

    rows = range(len(generators))
    if pool is None or len(generators) == 1:
        for row in rows:
            fill(row)
    else:
        list(pool.map(fill, rows))  # list() re-raises any worker's exception here
    return noise.log_().neg_()


def _outputs(raw_logits: torch.Tensor, token_ids: list[int], states: list[SamplingState]) -> list[SampleOutput]:
    """Wrap the chosen tokens, adding logprobs from the raw logits for the rows that asked for them."""
    wanted = [row for row, state in enumerate(states) if state.params.logprobs is not None]
    chosen: dict[int, float] = {}
    top: dict[int, list[tuple[int, float]]] = {}
    if wanted:
        index = torch.tensor(wanted, device=raw_logits.device)
        logprobs = raw_logits.index_select(0, index).float().log_softmax(dim=-1)
        picked = torch.tensor([token_ids[row] for row in wanted], device=raw_logits.device)
        chosen = dict(zip(wanted, logprobs.gather(1, picked[:, None]).squeeze(1).tolist(), strict=True))
        most = min(max(states[row].params.logprobs for row in wanted), raw_logits.shape[-1])
        top_values, top_ids = logprobs.topk(most, dim=-1)  # sorted, most likely first
        for row, ids, values in zip(wanted, top_ids.tolist(), top_values.tolist(), strict=True):
            count = states[row].params.logprobs
            top[row] = list(zip(ids[:count], values[:count], strict=True))
    return [
        SampleOutput(
            token_ids=[token_id],
            logprobs=[chosen[row]] if row in chosen else None,
            top_logprobs=[top[row]] if row in top else None,
        )
        for row, token_id in enumerate(token_ids)
    ]
