"""The batched sampler against the row-by-row reference, its batch invariance, its distributions and host reads."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dsinfer.sampling.sampler as sampler_module
from dsinfer.sampling import sampler_reference as reference
from dsinfer.sampling.sampler import Sampler, SamplingState, apply_penalties, make_sampling_state, suppress_stop_tokens
from dsinfer.sampling.token_counts import TokenCounts, count_tokens
from dsinfer.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
EOS = 3


def _state(prompt=None, output=None, eos=EOS, **params) -> SamplingState:
    state = make_sampling_state(SamplingParams(**params), [0] if prompt is None else prompt, eos)
    state.output_token_ids = list(output or [])
    return state


def _random_states(generator: torch.Generator, count: int, vocab_size: int) -> list[SamplingState]:
    """States with random prompts, outputs and penalties (some neutral, some with no tokens at all)."""
    states = []
    for index in range(count):
        choice = lambda values: values[int(torch.randint(len(values), (1,), generator=generator))]  # noqa: E731
        prompt = torch.randint(vocab_size, (choice([0, 1, 5, 40]),), generator=generator).tolist()
        output = torch.randint(vocab_size, (choice([0, 1, 3, 30]),), generator=generator).tolist()
        params = dict(
            repetition_penalty=choice([1.0, 1.3, 0.8]),
            presence_penalty=choice([0.0, 0.5, -1.25]),
            frequency_penalty=choice([0.0, 0.25, -0.75]),
            min_tokens=choice([0, 2, 50]),
            stop_token_ids=choice([[], [7], [vocab_size + 5, 1]]),
            seed=index,
            max_tokens=None,
        )
        states.append(_state(prompt=prompt, output=output, **params))
    return states


def _sample_many(logits_row: torch.Tensor, draws: int, **params) -> torch.Tensor:
    states = [_state(seed=seed, **params) for seed in range(draws)]
    outputs = Sampler()(logits_row.expand(draws, -1), states)
    return torch.tensor([output.token_ids[0] for output in outputs])


def _chi_square(draws: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of the draws against ``probs``; draws outside the support make it infinite."""
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    expected = probs.double() / probs.sum() * draws.numel()
    if (counts[expected == 0] > 0).any():
        return math.inf
    support = expected > 0
    return (((counts - expected) ** 2)[support] / expected[support]).sum().item()


# Upper 0.1% points of the chi-square distribution by degrees of freedom.
CHI_SQUARE_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32}


# --------------------------------------------------------------------------------------------
# Batched steps equal the row-by-row reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_equal_the_row_by_row_reference(device):
    generator = torch.Generator().manual_seed(0)
    for trial in range(5):
        states = _random_states(generator, 12, 64)
        scores = (torch.randn(12, 64, generator=generator) * 3).to(device)
        expected = reference.apply_penalties(scores.clone(), states)
        assert torch.equal(apply_penalties(scores.clone(), states), expected), trial


@pytest.mark.parametrize("device", DEVICES)
def test_cached_token_counts_follow_appended_tokens_and_dead_requests(device):
    generator = torch.Generator().manual_seed(1)
    cache = TokenCounts()
    states = _random_states(generator, 6, 50)
    for step in range(12):
        for state in states:
            state.output_token_ids += torch.randint(50, (step % 3,), generator=generator).tolist()  # 0-2 new
        if step == 5:
            states[2] = _random_states(generator, 1, 50)[0]  # a request ends, another takes its place
            states[4].output_token_ids = states[4].output_token_ids[:1]  # a rebuilt output is counted again
            gc.collect()
        counts, prompt_seen = cache.gather(states, 50, torch.device(device))
        fresh_counts, fresh_seen = count_tokens(states, 50, torch.device(device))
        assert torch.equal(counts, fresh_counts) and torch.equal(prompt_seen, fresh_seen), step
        scores = (torch.randn(6, 50, generator=generator) * 2).to(device)
        batched = sampler_module.penalise(
            scores,
            counts,
            prompt_seen,
            *(
                torch.tensor([getattr(s.params, name) for s in states], device=device)
                for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")
            ),
        )
        assert torch.equal(batched, reference.apply_penalties(scores.clone(), states)), step
    del states
    gc.collect()
    cache.gather([_state(repetition_penalty=1.5)], 50, torch.device(device))
    assert cache.rows_in_use == 1  # the dead requests' rows were taken back


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_with_penalties_follow_the_reference_over_steps(device):
    generator = torch.Generator().manual_seed(2)
    states = _random_states(generator, 9, 40)
    for state in states:
        state.params.temperature = 0.0
    sampler = Sampler()
    for step in range(10):
        logits = (torch.randn(9, 40, generator=generator) * 2).to(device)
        expected_scores = reference.suppress_stop_tokens(reference.apply_penalties(logits.clone(), states), states)
        tokens = [output.token_ids[0] for output in sampler(logits, states)]
        assert tokens == expected_scores.argmax(dim=-1).tolist(), step
        assert tokens == reference.sample_row_by_row(logits, states), step
        for state, token in zip(states, tokens, strict=True):
            state.output_token_ids.append(token)


@pytest.mark.parametrize("device", DEVICES)
def test_min_tokens_masking_equals_the_reference(device):
    generator = torch.Generator().manual_seed(3)
    states = _random_states(generator, 16, 30)
    scores = torch.randn(16, 30, generator=generator).to(device)
    assert torch.equal(suppress_stop_tokens(scores.clone(), states), reference.suppress_stop_tokens(scores, states))


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_log_softmax_of_the_raw_logits(device):
    generator = torch.Generator().manual_seed(4)
    logits = (torch.randn(7, 90, generator=generator) * 4).to(device, torch.bfloat16)
    states = [
        _state(logprobs=5, temperature=0.5, repetition_penalty=1.5, prompt=[1, 2, 3], seed=0),
        _state(logprobs=0, seed=1),
        _state(seed=2),
        _state(logprobs=20, temperature=0.0, min_tokens=3),
        _state(logprobs=2, top_p=0.5, seed=4),
        _state(temperature=0.0),
        _state(logprobs=1, top_k=3, presence_penalty=1.0, output=[5, 5], seed=6),
    ]
    outputs = Sampler()(logits, states)
    tokens = [output.token_ids[0] for output in outputs]
    expected = reference.logprobs(logits.cpu(), tokens, states)
    full = logits.cpu().float().log_softmax(dim=-1)
    for output, want, row in zip(outputs, expected, range(7), strict=True):
        if want is None:
            assert output.logprobs is None and output.top_logprobs is None
            continue
        assert math.isclose(output.logprobs[0], want[0], abs_tol=1e-5)
        assert math.isclose(output.logprobs[0], full[row, output.token_ids[0]].item(), abs_tol=1e-5)
        assert [token for token, _ in output.top_logprobs[0]] == [token for token, _ in want[1]]
        pairs = zip(output.top_logprobs[0], want[1], strict=True)
        assert all(math.isclose(a, b, abs_tol=1e-5) for (_, a), (_, b) in pairs)


# --------------------------------------------------------------------------------------------
# Batch invariance and replay
# --------------------------------------------------------------------------------------------

PROBE = dict(seed=1234, temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.1, logprobs=2)


def _companions() -> list[SamplingState]:
    return [
        _state(seed=7, temperature=1.3),
        _state(temperature=0.0, frequency_penalty=0.5),
        _state(top_p=0.5, presence_penalty=1.0),
        _state(seed=1234, temperature=0.5),  # same seed, different params
        _state(min_p=0.2, logprobs=3, min_tokens=4),
        _state(top_k=5, frequency_penalty=-1.0, seed=3),
    ]


def _run(steps: list[torch.Tensor], row: int, companions: list[SamplingState]) -> list[int]:
    """The probe request for len(steps) steps at ``row`` of a batch; companions get random logits."""
    probe = _state(**PROBE)
    sampler = Sampler()
    generator = torch.Generator().manual_seed(row)
    for logits in steps:
        batch = companions[:row] + [probe] + companions[row:]
        batch_logits = (torch.randn(len(batch), logits.shape[-1], generator=generator) * 3).to(logits.device)
        batch_logits[row] = logits
        outputs = sampler(batch_logits, batch)
        for state, output in zip(batch, outputs, strict=True):
            state.output_token_ids.append(output.token_ids[0])
    return probe.output_token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_draws_the_same_alone_and_at_any_row_of_a_batch_of_seven(device):
    generator = torch.Generator().manual_seed(5)
    steps = [(torch.randn(300, generator=generator) * 2).to(device) for _ in range(30)]
    alone = _run(steps, 0, [])
    assert len(set(alone)) > 10  # really sampling
    assert _run(steps, 0, []) == alone  # repeated run
    for row in (0, 3, 6):
        assert _run(steps, row, _companions()) == alone, row


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_depends_only_on_seed_and_output_position(device):
    """Counter-based noise needs no history: a fresh sampler resumes a request mid-way and draws the same."""
    generator = torch.Generator().manual_seed(6)
    steps = [(torch.randn(200, generator=generator) * 2).to(device) for _ in range(12)]
    alone = _run(steps, 0, [])
    for position in (0, 5, 11):
        resumed = _state(output=alone[:position], **PROBE)
        assert Sampler()(steps[position][None], [resumed])[0].token_ids == [alone[position]]


def test_completions_of_one_seeded_request_are_independent_draws():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    draws = 4000
    params = SamplingParams(seed=42)
    states = [make_sampling_state(params, [0], None, sample_index=index) for index in range(draws)]
    tokens = torch.tensor([o.token_ids[0] for o in Sampler()(probs.log().expand(draws, -1), states)])
    assert _chi_square(tokens, probs) < CHI_SQUARE_999[3]


# --------------------------------------------------------------------------------------------
# Distributions (chi-square on a tiny vocabulary)
# --------------------------------------------------------------------------------------------

LOGITS = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 1.2, 0.7])
DRAWS = 12000


def test_temperature_distribution():
    for temperature in (0.5, 1.0, 1.7):
        expected = torch.softmax(LOGITS.double() / temperature, dim=-1)
        assert _chi_square(_sample_many(LOGITS, DRAWS, temperature=temperature), expected) < CHI_SQUARE_999[7]


def test_top_k_distribution():
    expected = torch.softmax(LOGITS.double() / 0.8, dim=-1)
    kept = torch.zeros(8, dtype=torch.bool)
    kept[[3, 6, 0]] = True  # the three largest logits
    draws = _sample_many(LOGITS, DRAWS, top_k=3, temperature=0.8)
    assert _chi_square(draws, expected * kept) < CHI_SQUARE_999[2]


def test_top_p_distribution():
    probs = torch.tensor([0.35, 0.25, 0.2, 0.12, 0.08])
    # Mass before each token: 0, .35, .6, .8, .92; top_p = 0.7 keeps the first three.
    draws = _sample_many(probs.log(), DRAWS, top_p=0.7)
    assert _chi_square(draws, probs * torch.tensor([1, 1, 1, 0, 0])) < CHI_SQUARE_999[2]


def test_min_p_distribution():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    draws = _sample_many(probs.log(), DRAWS, min_p=0.3)  # cut at 0.12: the first three stay
    assert _chi_square(draws, probs * torch.tensor([1, 1, 1, 0, 0])) < CHI_SQUARE_999[2]


def test_filters_combined_with_temperature_distribution():
    # T = 0.5 squares the probabilities: (.16, .09, .04, .01, .0025) / .3025; top_k = 4 drops the last;
    # top_p = 0.9 then keeps the first three (mass before the fourth: .29 / .3 = .967 >= .9).
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.05])
    draws = _sample_many(probs.log(), DRAWS, temperature=0.5, top_k=4, top_p=0.9)
    expected = probs.double() ** 2 * torch.tensor([1, 1, 1, 0, 0])
    assert _chi_square(draws, expected) < CHI_SQUARE_999[2]


# --------------------------------------------------------------------------------------------
# Host reads
# --------------------------------------------------------------------------------------------

aten = torch.ops.aten
HOST_READS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.is_nonzero.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.bincount.default,
}


class RefuseHostReads(TorchDispatchMode):
    """Refuses the aten ops that need a device value on the host (see tests/test_forward_host_reads.py)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise AssertionError(f"{func} reads a device value on the host")
        index = args[1] if func in (aten.index.Tensor, aten.index_put_.default, aten._index_put_impl_.default) else []
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index or []):
            raise AssertionError("boolean-mask indexing reads how many entries survive on the host")
        return func(*args, **kwargs or {})


def test_a_step_reads_the_device_once(monkeypatch):
    reads = []
    real_read_back = sampler_module.start_read_back

    def counting_read_back(*tensors):
        reads.append(len(tensors))
        return real_read_back(*tensors)

    monkeypatch.setattr(sampler_module, "start_read_back", counting_read_back)
    states = [
        _state(temperature=0.0, repetition_penalty=1.2, prompt=[1, 2], output=[4]),
        _state(seed=1, top_p=0.9, top_k=20, min_p=0.05, logprobs=3, min_tokens=5),
        _state(seed=2, frequency_penalty=0.5, presence_penalty=0.3, output=[7, 7]),
        _state(logprobs=0),
    ]
    sampler = Sampler()
    logits = torch.randn(4, 64)
    with RefuseHostReads():
        for _ in range(3):
            outputs = sampler(logits, states)
            for state, output in zip(states, outputs, strict=True):
                state.output_token_ids.append(output.token_ids[0])
    assert reads == [4, 4, 4]  # one read per step: tokens, logprobs, top-n values and ids together


# --------------------------------------------------------------------------------------------
# What speculative decoding draws with
# --------------------------------------------------------------------------------------------


def test_accept_uniforms_depend_on_position_only():
    state = _state(seed=9, output=[1, 2, 3])
    five = sampler_module.accept_uniforms(state, 5, "cpu")
    assert torch.equal(sampler_module.accept_uniforms(state, 2, "cpu"), five[:2])  # the draft count changes nothing
    later = _state(seed=9, output=[1, 2, 3, 4])
    assert torch.equal(sampler_module.accept_uniforms(later, 4, "cpu"), five[1:])  # keyed by absolute position
    assert ((five >= 0) & (five < 1)).all() and len(set(five.tolist())) == 5


def test_race_at_the_next_position_draws_what_the_sampler_draws():
    generator = torch.Generator().manual_seed(8)
    for seed in range(20):
        logits = torch.randn(1, 50, generator=generator) * 2
        state = _state(seed=seed, output=[4] * (seed % 3))
        probs = sampler_module.filtered_probs(logits, [state.params])
        drawn = sampler_module.race_at(probs, state, len(state.output_token_ids))
        assert drawn.tolist() == Sampler()(logits, [state])[0].token_ids
