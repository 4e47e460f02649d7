"""The sampler: turn one row of next-token logits per request into one token per request.

Each row goes through, in this order: penalties (repetition on prompt + output tokens, presence and
frequency on output tokens) -> stop tokens masked while the output is shorter than ``min_tokens`` ->
the structured-output grammar's mask, for rows that have one -> greedy argmax, or temperature -> top-k ->
top-p -> min-p -> an exponential race.

Batch invariance is the design constraint. A request's token depends only on its own logits, its own seed and
its output position, never on which row it sits in or what else is in the batch: the race's noise is a pure
function of (seed, sample index, output position, vocab column) (:mod:`dsinfer.sampling.noise`), so it
needs no per-request generator state and is the same on every device, and every other step is an elementwise
or per-row operation with each row's own parameters. A seeded request therefore replays exactly.

The whole batch is sampled in a few batched device ops: per-row parameters travel as small tensors (pinned,
non-blocking copies), the penalties read per-request token counts kept on the device
(:class:`~dsinfer.sampling.token_counts.TokenCounts`), grammar masks are filled into one bitmask and applied in
one add (:mod:`dsinfer.sampling.grammar_masks`), and the host reads the device once per step: the chosen tokens
and, when asked for, their logprobs. A batch of greedy rows that nothing masks or penalises skips all of that:
its tokens are the ops seam's ``greedy_argmax`` of the raw logits (on CUDA two short Triton passes, where
``torch.argmax`` of one vocabulary row is a single slow block).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsinfer.ops.registry import resolve
from dsinfer.sampling.grammar_masks import apply_grammar_masks
from dsinfer.sampling.host_copies import HostCopies, device_index, start_read_back, to_device
from dsinfer.sampling.noise import ACCEPT_STREAM, RACE_STREAM, key_tensor, noise_key, race, uniforms
from dsinfer.sampling.token_counts import TokenCounts, count_tokens
from dsinfer.sampling_params import SamplingParams

if TYPE_CHECKING:  # importing xgrammar costs seconds; only requests with structured output need it
    from dsinfer.sampling.structured_output import GrammarConstraint

_SEED_MODULUS = 2**64  # torch.Generator.manual_seed takes 64-bit seeds; wider or negative seeds wrap


@dataclass
class SamplingState:
    """What the sampler needs to know about one request; owned by the engine's sequence, never mutated here."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the engine appends each token it accepts
    stop_token_ids: frozenset[int]  # eos (unless ignore_eos) and params.stop_token_ids
    generator: torch.Generator  # CPU generator owned by this request alone (speculative verification draws)
    constraint: GrammarConstraint | None = None  # structured output; the engine advances it, we only read it
    seed: int = 0  # the noise key's seed: params.seed, or a random one for unseeded requests
    sample_index: int = 0  # which of the request's n completions: part of the noise key

    def noise_key(self, position: int | None = None, stream: int = RACE_STREAM) -> int:
        """The key of this request's noise at output ``position`` (default: the next token's)."""
        position = len(self.output_token_ids) if position is None else position
        return noise_key(self.seed, self.sample_index, position, stream)


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
    """Build a request's state: its stop ids, its noise seed and its own generator.

    ``sample_index`` tells apart the ``n`` completions of one request: it is part of the noise key, so they
    differ from each other yet each replays exactly (the generator is seeded with ``seed + i``). Unseeded
    requests draw a fresh seed from the operating system, so no two requests share a random stream.
    ``constraint`` is this completion's own structured-output grammar state (never shared between completions).
    """
    stop_token_ids = set(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        stop_token_ids.add(eos_token_id)
    seed = secrets.randbits(64) if params.seed is None else params.seed
    generator = torch.Generator(device="cpu")
    generator.manual_seed((seed + sample_index) % _SEED_MODULUS)
    return SamplingState(
        params, list(prompt_token_ids), [], frozenset(stop_token_ids), generator, constraint, seed, sample_index
    )


class Sampler:
    """Choose the next token of every request in a batch.

    ``Sampler()(logits, states)`` takes ``logits`` of shape ``[B, V]`` (any float dtype, any device; row ``i``
    belongs to ``states[i]``) and returns one :class:`SampleOutput` per state, in the same order. Neither the
    logits nor the states are modified.

    Logprobs are the ``log_softmax`` of the raw model logits, before penalties, ``min_tokens`` masking and
    temperature, as vLLM reports them by default: they describe what the model believes, not the filtered
    distribution the token was drawn from.

    The sampler keeps device rows of token counts for the requests with penalties (released when the request
    object is gone); one thread calls it.
    """

    def __init__(self) -> None:
        self._token_counts = TokenCounts()
        # The last call's chosen ids, still on the device: a step launched before the host has read them takes
        # its sequences' input tokens from here (dsinfer.engine.device_worker).
        self.last_token_ids: torch.Tensor | None = None

    def __call__(
        self, logits: torch.Tensor, states: list[SamplingState], output_positions: list[int] | None = None
    ) -> list[SampleOutput]:
        """Sample one token per row; see the class docstring for the contract."""
        return self.launch(logits, states, output_positions).result()

    def launch(
        self, logits: torch.Tensor, states: list[SamplingState], output_positions: list[int] | None = None
    ) -> PendingOutputs:
        """Queue the sampling on the device; the outputs come from the returned handle's ``result()``, which
        waits for the device. The caller may queue more device work (the next step) before that.

        ``output_positions``: each row's output position (the noise key's), fixed when the step was planned;
        None reads it off the state (``len(output_token_ids)``), which is right when nobody appends meanwhile."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [len(states)={len(states)}, vocab], got {tuple(logits.shape)}")
        if not states:
            return PendingOutputs.done([])
        positions = output_positions or [len(state.output_token_ids) for state in states]
        plain = (state.params.greedy and not reads_output_so_far(state) and not masks_stop_tokens(state, position)
                 for state, position in zip(states, positions, strict=True))  # fmt: skip
        if all(plain):
            # Nothing changes these rows' scores: the argmax of the raw logits is the float32 copy's (exact).
            token_ids = resolve(logits.device, logits.dtype).greedy_argmax(logits)
            self.last_token_ids = token_ids
            return _launch_outputs(logits, token_ids, states)
        scores = logits.to(torch.float32, copy=True)
        penalised = [row for row, state in enumerate(states) if _has_penalties(state.params)]
        if penalised:
            rows = [states[row] for row in penalised]
            counts, prompt_seen = self._token_counts.gather(rows, scores.shape[-1], scores.device)
            _penalise_rows(scores, penalised, rows, counts, prompt_seen)
        suppress_stop_tokens(scores, states, positions)
        apply_constraints(scores, states)
        token_ids = choose_token_tensor(scores, states, output_positions)
        self.last_token_ids = token_ids
        return _launch_outputs(logits, token_ids, states)


def reads_output_so_far(state: SamplingState) -> bool:
    """Whether sampling this state's next token reads its output tokens (penalties count them, a grammar has
    accepted them). Such a row can only be sampled once the host has every earlier token; any other row needs no
    more than its planned output position (``min_tokens`` included: :func:`masks_stop_tokens`)."""
    return _has_penalties(state.params) or state.constraint is not None


def masks_stop_tokens(state: SamplingState, position: int | None = None) -> bool:
    """Whether the token at output ``position`` (default: the next, ``len(output_token_ids)``) is drawn with the
    stop tokens masked: ``min_tokens`` not met yet and some stop token to mask. It needs the output's length
    only, never its tokens, so a step planned before the host has the previous token can apply it."""
    position = len(state.output_token_ids) if position is None else position
    return position < state.params.min_tokens and bool(state.stop_token_ids)


def _has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def apply_penalties(scores: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Apply each row's repetition, presence and frequency penalties to ``scores`` in place; returns it.

    Repetition (HF / vLLM): every token seen in prompt or output has a positive logit divided by the
    penalty and a negative one multiplied by it. Presence and frequency (OpenAI): a token generated
    ``c`` times loses ``frequency_penalty * c + presence_penalty * (c > 0)``; the prompt does not count.
    The counts are built from the states' token lists (no cache), so a state may describe a hypothetical
    output (speculative drafts appended).
    """
    penalised = [row for row, state in enumerate(states) if _has_penalties(state.params)]
    if penalised:
        rows = [states[row] for row in penalised]
        counts, prompt_seen = count_tokens(rows, scores.shape[-1], scores.device)
        _penalise_rows(scores, penalised, rows, counts, prompt_seen)
    return scores


def _penalise_rows(scores, penalised: list[int], states, counts: torch.Tensor, prompt_seen: torch.Tensor) -> None:
    """Penalise rows ``penalised`` of ``scores`` in place, from their counts and prompt masks."""
    device = scores.device
    rows_of_values = [
        [s.params.repetition_penalty, s.params.presence_penalty, s.params.frequency_penalty] for s in states
    ]
    values = to_device(rows_of_values, torch.float32, device)
    whole = len(penalised) == scores.shape[0]
    index = None if whole else device_index(penalised, device)
    rows = scores if whole else scores[index]
    rows = penalise(rows, counts, prompt_seen, values[:, 0], values[:, 1], values[:, 2])
    if whole:
        scores.copy_(rows)
    else:
        scores.index_copy_(0, index, rows)


def penalise(
    scores: torch.Tensor,
    counts: torch.Tensor,
    prompt_seen: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """The penalties as tensor ops: ``scores`` float32 ``[n, V]``, ``counts`` of output tokens ``[n, V]``,
    ``prompt_seen`` bool ``[n, V]``, one penalty of each kind per row. Neutral values leave a row bit-exact."""
    generated = counts > 0
    repetition = repetition[:, None]
    repeated = torch.where(scores > 0, scores / repetition, scores * repetition)
    scores = torch.where(prompt_seen | generated, repeated, scores)
    return scores - (frequency[:, None] * counts + presence[:, None] * generated)


def suppress_stop_tokens(
    scores: torch.Tensor, states: list[SamplingState], output_positions: list[int] | None = None
) -> torch.Tensor:
    """Mask the stop token ids of rows whose output is still shorter than ``min_tokens`` (at ``output_positions``,
    default the states' output lengths); in place, returns it.

    Ids beyond the vocabulary are ignored: ``stop_token_ids`` come from the user, who cannot know our vocab.
    A row whose structured-output grammar is complete is left alone: the grammar's end wins over
    ``min_tokens``, since masking eos there could leave no token at all.
    """
    vocab_size = scores.shape[-1]
    rows: list[int] = []
    token_ids: list[int] = []
    positions = output_positions or [len(state.output_token_ids) for state in states]
    for row, (state, position) in enumerate(zip(states, positions, strict=True)):
        if not masks_stop_tokens(state, position):
            continue
        if state.constraint is not None and state.constraint.is_completed():
            continue
        blocked = [token_id for token_id in state.stop_token_ids if token_id < vocab_size]
        rows += [row] * len(blocked)
        token_ids += blocked
    if token_ids:
        where = (device_index(rows, scores.device), device_index(token_ids, scores.device))
        scores.index_put_(where, torch.full((), float("-inf"), device=scores.device))
    return scores


def apply_constraints(scores: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Mask, in place, the tokens each constrained row's grammar forbids next; returns ``scores``."""
    return apply_grammar_masks(scores, [state.constraint for state in states])


def choose_token_tensor(
    scores: torch.Tensor, states: list[SamplingState], output_positions: list[int] | None = None
) -> torch.Tensor:
    """Greedy rows take the argmax (lowest id on ties); the others race on their filtered probabilities, with
    the noise of their output position (``output_positions``, else each state's next one).

    Returns the chosen ids as an int64 device tensor ``[B]`` (nothing is read back to the host here).
    """
    sampled_rows = [row for row, state in enumerate(states) if not state.params.greedy]
    if not sampled_rows:
        return scores.argmax(dim=-1)  # torch.argmax returns the first maximum: the lowest id wins ties
    sampled_states = [states[row] for row in sampled_rows]
    positions = [None] * len(sampled_rows) if output_positions is None else [output_positions[r] for r in sampled_rows]
    keys = key_tensor([state.noise_key(p) for state, p in zip(sampled_states, positions, strict=True)], scores.device)
    if len(sampled_rows) == len(states):
        return race(filtered_probs(scores, [state.params for state in states]), keys)
    token_ids = scores.argmax(dim=-1)
    index = device_index(sampled_rows, scores.device)
    probs = filtered_probs(scores[index], [state.params for state in sampled_states])
    return token_ids.index_copy_(0, index, race(probs, keys))


def accept_uniforms(state: SamplingState, count: int, device: torch.device | str) -> torch.Tensor:
    """Speculative decoding's accept / reject uniforms for drafts at the next ``count`` output positions.

    Float32 ``[count]`` in ``[0, 1)``: the draft at output position ``p`` always gets the uniform keyed by
    ``(seed, sample index, p)`` on :data:`~dsinfer.sampling.noise.ACCEPT_STREAM`, however many drafts are
    verified with it and whatever the batch, so seeded speculative runs replay and stay batch-invariant.
    """
    start = len(state.output_token_ids)
    keys = key_tensor([state.noise_key(start + offset, ACCEPT_STREAM) for offset in range(count)], device)
    return uniforms(keys, 1).view(count)


def race_at(probs: torch.Tensor, state: SamplingState, position: int) -> torch.Tensor:
    """Draw from one row of unnormalised ``probs`` ``[1, V]`` with the race noise of output ``position``: the
    noise plain decoding uses there (a speculative correction or bonus token). Returns int64 ``[1]``."""
    return race(probs, key_tensor([state.noise_key(position)], probs.device))


def filtered_probs(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, batched with one parameter per row.

    The result is unnormalised after min-p (tokens below the cut are zeroed, the rest keep their mass):
    the exponential race picks token ``i`` with probability ``p_i / sum(p)``, so scaling does not matter.
    """
    values = to_device([[p.temperature, p.top_k, p.top_p, p.min_p] for p in params], torch.float32, scores.device)
    use_top = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
    use_min_p = any(p.min_p > 0 for p in params)
    return filter_probs(scores, values[:, 0], values[:, 1], values[:, 2], values[:, 3], use_top, use_min_p)


def filter_probs(
    scores: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    use_top: bool = True,
    use_min_p: bool = True,
) -> torch.Tensor:
    """:func:`filtered_probs` on per-row parameter tensors (``top_k`` may be float: its values are integers);
    ``use_top`` / ``use_min_p`` False skip the filters that no row uses (their neutral values change nothing).

    A row without top-k or top-p keeps its scores whatever the other rows use: the nucleus cut at ``top_p = 1``
    would drop tail tokens wherever the float32 running sum reaches 1 early, so a row's probabilities would
    depend on its batch (and a captured step, which always runs the filter, would differ from an eager one)."""
    scores = scores / temperature[:, None]
    if use_top:
        uses_top = (top_k > 0) | (top_p < 1.0)
        scores = torch.where(uses_top[:, None], _mask_top_k_top_p(scores, top_k, top_p), scores)
    probs = scores.softmax(dim=-1)
    if use_min_p:
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
    """One row of Exp(1) noise per CPU generator (speculative verification still draws from the generator).

    Drawn as ``-log(U)`` from ``torch.rand``, several times faster on CPU than ``Tensor.exponential_``.
    ``U == 0`` gives ``inf``, which only drops that token from this one race (``p / inf == 0``). Each row is
    filled by its own generator alone, so spreading rows over ``pool`` threads changes no value. Plain
    sampling uses the counter-based noise of :mod:`dsinfer.sampling.noise` instead.
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


class PendingOutputs:
    """A step's sample outputs whose values are still being copied to the host: ``result()`` waits for the
    copies (once) and builds the :class:`SampleOutput` list."""

    def __init__(self, copies: HostCopies | None, build) -> None:
        self._copies, self._build, self._outputs = copies, build, None

    @classmethod
    def done(cls, outputs: list[SampleOutput]) -> PendingOutputs:
        pending = cls(None, None)
        pending._outputs = outputs
        return pending

    def result(self) -> list[SampleOutput]:
        if self._outputs is None:
            self._outputs = self._build(*self._copies.wait())
            self._copies = self._build = None
        return self._outputs


def _outputs(
    raw_logits: torch.Tensor, token_ids: list[int] | torch.Tensor, states: list[SamplingState]
) -> list[SampleOutput]:
    """Wrap the chosen tokens, adding logprobs from the raw logits for the rows that asked for them.

    ``token_ids`` may be a device tensor: the tokens, their logprobs and the top-n come back to the host in
    one read (non-blocking copies, then one wait on the stream).
    """
    return _launch_outputs(raw_logits, token_ids, states).result()


def _launch_outputs(
    raw_logits: torch.Tensor, token_ids: list[int] | torch.Tensor, states: list[SamplingState]
) -> PendingOutputs:
    """:func:`_outputs` with the read-back queued, not waited for."""
    device = raw_logits.device
    tokens = token_ids if isinstance(token_ids, torch.Tensor) else torch.tensor(token_ids, device=device)
    wanted = [row for row, state in enumerate(states) if state.params.logprobs is not None]
    if not wanted:

        def plain(host_tokens: torch.Tensor) -> list[SampleOutput]:
            return [SampleOutput([token_id], None, None) for token_id in host_tokens.tolist()]

        return PendingOutputs(start_read_back(tokens), plain)
    whole = len(wanted) == len(states)
    index = None if whole else device_index(wanted, device)
    logprobs = (raw_logits if whole else raw_logits[index]).float().log_softmax(dim=-1)
    picked = tokens if whole else tokens[index]
    chosen = logprobs.gather(1, picked[:, None]).squeeze(1)
    most = min(max(states[row].params.logprobs for row in wanted), raw_logits.shape[-1])
    top_values, top_ids = logprobs.topk(most, dim=-1)  # sorted, most likely first

    def with_logprobs(host_tokens, host_chosen, host_values, host_ids) -> list[SampleOutput]:
        token_list = host_tokens.tolist()
        chosen_by_row = dict(zip(wanted, host_chosen.tolist(), strict=True))
        top: dict[int, list[tuple[int, float]]] = {}
        for row, ids, values in zip(wanted, host_ids.tolist(), host_values.tolist(), strict=True):
            count = states[row].params.logprobs
            top[row] = list(zip(ids[:count], values[:count], strict=True))
        return [
            SampleOutput(
                token_ids=[token_id],
                logprobs=[chosen_by_row[row]] if row in chosen_by_row else None,
                top_logprobs=[top[row]] if row in top else None,
            )
            for row, token_id in enumerate(token_list)
        ]

    return PendingOutputs(start_read_back(tokens, chosen, top_values, top_ids), with_logprobs)
