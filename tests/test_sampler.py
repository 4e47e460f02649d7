"""Tests for SamplingParams validation and the batch-invariant sampler in dsinfer.sampling.sampler."""

from __future__ import annotations

import copy
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dsinfer.sampling.sampler import (
    Sampler,
    SamplingState,
    apply_penalties,
    exponential_noise,
    make_sampling_state,
)
from dsinfer.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
EOS = 3


def _state(prompt: list[int] | None = None, eos: int | None = EOS, **params) -> SamplingState:
    return make_sampling_state(SamplingParams(**params), prompt or [0], eos)


def _probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def _sample_many(logits_row: torch.Tensor, draws: int, **params) -> torch.Tensor:
    """One step for `draws` requests with seeds 0..draws-1 sharing one logits row: independent samples."""
    states = [_state(seed=seed, **params) for seed in range(draws)]
    outputs = Sampler()(logits_row.expand(draws, -1), states)
    return torch.tensor([output.token_ids[0] for output in outputs])


def _generate(state: SamplingState, logits_per_step: list[torch.Tensor], row: int, companions: list) -> list[int]:
    """Run a state for several steps at `row` of a batch, appending its tokens as the engine would."""
    sampler = Sampler()
    for step, logits in enumerate(logits_per_step):
        batch_states = companions[:row] + [state] + companions[row:]
        batch_logits = torch.randn(len(batch_states), logits.shape[-1], device=logits.device) * 3
        batch_logits[row] = logits
        outputs = sampler(batch_logits, batch_states)
        state.output_token_ids.append(outputs[row].token_ids[0])
        for index, companion in enumerate(companions):
            companion.output_token_ids.append(outputs[index if index < row else index + 1].token_ids[0])
        assert len(state.output_token_ids) == step + 1
    return state.output_token_ids


# --------------------------------------------------------------------------------------------
# SamplingParams
# --------------------------------------------------------------------------------------------


def test_defaults_and_normalisation():
    params = SamplingParams(stop="###", temperature=1, stop_token_ids=(5, 6))
    assert params.stop == ["###"] and params.stop_token_ids == [5, 6]
    assert isinstance(params.temperature, float)
    assert not params.greedy and SamplingParams(temperature=0).greedy
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("max_tokens", 0),
        ("max_tokens", "16"),
        ("min_tokens", -1),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "0.7"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("top_p", None),
        ("top_k", -2),
        ("top_k", 2.0),
        ("top_k", True),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.1),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", False),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("seed", 1.5),
        ("seed", "42"),
        ("seed", True),
        ("stop", 5),
        ("stop", ["ok", 5]),
        ("stop", [""]),
        ("stop_token_ids", [1, -1]),
        ("stop_token_ids", "7"),
        ("stop_token_ids", [1.0]),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
        ("include_stop_str_in_output", None),
    ],
)
def test_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)
    assert SamplingParams(min_tokens=10, max_tokens=None).min_tokens == 10


def test_boundary_values_are_accepted():
    SamplingParams(top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2, frequency_penalty=2, logprobs=20, seed=-5)


# --------------------------------------------------------------------------------------------
# States
# --------------------------------------------------------------------------------------------


def test_stop_ids_include_eos_unless_ignore_eos():
    assert _state(stop_token_ids=[7]).stop_token_ids == frozenset({EOS, 7})
    assert _state(stop_token_ids=[7], ignore_eos=True).stop_token_ids == frozenset({7})
    assert _state(eos=None).stop_token_ids == frozenset()


# --------------------------------------------------------------------------------------------
# Greedy and its limits
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_with_lowest_id_on_ties(device):
    logits = torch.randn(6, 50, device=device)
    logits[5] = 0.0
    logits[5, [7, 9, 30]] = 4.0
    outputs = Sampler()(logits, [_state(temperature=0.0) for _ in range(6)])
    assert [o.token_ids[0] for o in outputs[:5]] == logits[:5].argmax(dim=-1).tolist()
    assert outputs[5].token_ids == [7]


def test_temperature_towards_zero_approaches_argmax():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1)) * 2
    assert (_sample_many(logits, 300, temperature=1e-3) == logits.argmax()).all()
    # At T = 1 the same draws do spread out, so the check above is not vacuous.
    assert len(set(_sample_many(logits, 300, temperature=1.0).tolist())) > 5


def test_top_k_one_equals_greedy():
    logits = torch.randn(8, 100) * 3
    sampled = Sampler()(logits, [_state(top_k=1, temperature=1.5, seed=i) for i in range(8)])
    greedy = Sampler()(logits, [_state(temperature=0.0) for _ in range(8)])
    assert [o.token_ids for o in sampled] == [o.token_ids for o in greedy]


# --------------------------------------------------------------------------------------------
# Filters
# --------------------------------------------------------------------------------------------


def test_top_k_keeps_only_the_k_most_likely():
    logits = _probs_logits([0.1, 0.4, 0.05, 0.3, 0.15])
    draws = _sample_many(logits, 2000, top_k=2)
    assert set(draws.tolist()) == {1, 3}
    # Renormalised over the survivors: 0.4 / 0.7 of the draws are token 1.
    assert abs((draws == 1).float().mean().item() - 4 / 7) < 0.04


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = _probs_logits([0.5, 0.3, 0.15, 0.05])
    assert set(_sample_many(logits, 2000, top_p=0.75).tolist()) == {0, 1}
    assert set(_sample_many(logits, 2000, top_p=0.85).tolist()) == {0, 1, 2}
    assert set(_sample_many(logits, 500, top_p=0.4).tolist()) == {0}


def test_top_p_applies_after_top_k():
    # After top-k=2 the survivors are renormalised to (0.625, 0.375): top_p=0.6 keeps only the first.
    logits = _probs_logits([0.5, 0.3, 0.15, 0.05])
    assert set(_sample_many(logits, 500, top_k=2, top_p=0.6).tolist()) == {0}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    logits = _probs_logits([0.5, 0.3, 0.15, 0.05])
    assert set(_sample_many(logits, 2000, min_p=0.5).tolist()) == {0, 1}  # cut at 0.25
    assert set(_sample_many(logits, 2000, min_p=0.2).tolist()) == {0, 1, 2}  # cut at 0.1


def test_samples_follow_softmax_of_logits_over_temperature():
    temperature = 0.7
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 1.2, 0.7])
    draws = 20000
    counts = torch.bincount(_sample_many(logits, draws, temperature=temperature), minlength=8).double()
    expected = torch.softmax(logits.double() / temperature, dim=-1) * draws
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 24.3  # 7 degrees of freedom, p = 0.001
    # The same draws are far from the T = 1 distribution: the temperature is really applied.
    expected_at_one = torch.softmax(logits.double(), dim=-1) * draws
    assert ((counts - expected_at_one) ** 2 / expected_at_one).sum().item() > 200


# --------------------------------------------------------------------------------------------
# Penalties and min_tokens
# --------------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    state = _state(prompt=[0, 1, 1], repetition_penalty=2.0)
    state.output_token_ids = [4]
    penalised = apply_penalties(logits.clone(), [state])
    assert torch.equal(penalised, torch.tensor([[1.0, -2.0, 0.5, 3.0, -4.0, 1.0]]))


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    state = _state(prompt=[5, 5, 5], presence_penalty=0.5, frequency_penalty=0.25)
    state.output_token_ids = [2, 2, 2, 0]
    penalised = apply_penalties(logits.clone(), [state])
    # token 2: 0.5 - 3 * 0.25 - 0.5; token 0: 2 - 0.25 - 0.5; prompt token 5 untouched.
    assert torch.allclose(penalised, torch.tensor([[1.25, -1.0, -0.75, 3.0, -2.0, 1.0]]))


def test_plain_greedy_rows_take_the_ops_argmax_of_the_raw_logits(monkeypatch):
    """Greedy rows nothing masks or penalises go straight to ``greedy_argmax`` on the raw (bf16) logits; one row
    with a penalty, a pending ``min_tokens`` or sampling sends the batch through the float32 path."""
    import dsinfer.sampling.sampler as sampler_module

    seen = []
    real = sampler_module.resolve

    class Table:
        def __init__(self, device, dtype):
            self.table = real(device, dtype)

        def greedy_argmax(self, scores):
            seen.append(scores)
            return self.table.greedy_argmax(scores)

    monkeypatch.setattr(sampler_module, "resolve", Table)
    logits = (torch.randn(3, 40) * 3).to(torch.bfloat16)
    logits[2, [11, 5]] = 20.0  # a tie: the lowest id
    plain = Sampler()(logits, [_state(temperature=0.0) for _ in range(3)])
    assert len(seen) == 1 and seen[0] is logits
    assert [o.token_ids[0] for o in plain] == logits.float().argmax(dim=-1).tolist()
    assert plain[2].token_ids == [5]
    others = [_state(temperature=0.0, repetition_penalty=1.1), _state(temperature=0.0, min_tokens=1),
              _state(temperature=0.7, seed=1)]  # fmt: skip
    for other in others:
        Sampler()(logits[:2], [_state(temperature=0.0), other])
    assert len(seen) == 1


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0]])
    state = _state(prompt=[1], temperature=0.0, repetition_penalty=1.2)
    assert Sampler()(logits, [state])[0].token_ids == [2]
    assert Sampler()(logits, [_state(prompt=[1], temperature=0.0)])[0].token_ids == [1]


def test_min_tokens_suppresses_stop_tokens_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 10.0
    logits[0, 7] = 9.0
    logits[0, 5] = 1.0
    state = _state(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    sampler = Sampler()
    assert sampler(logits, [state])[0].token_ids == [5]
    state.output_token_ids.append(5)
    assert sampler(logits, [state])[0].token_ids == [5]
    state.output_token_ids.append(5)
    assert sampler(logits, [state])[0].token_ids == [EOS]
    # With ignore_eos, eos is an ordinary token and is not suppressed.
    assert sampler(logits, [_state(temperature=0.0, min_tokens=2, ignore_eos=True)])[0].token_ids == [EOS]


def test_min_tokens_ignores_stop_ids_beyond_the_vocabulary():
    logits = torch.zeros(1, 10)
    logits[0, EOS] = 5.0
    state = _state(temperature=0.0, min_tokens=1, stop_token_ids=[10_000])
    assert Sampler()(logits, [state])[0].token_ids == [0]


# --------------------------------------------------------------------------------------------
# Seeds and batch invariance
# --------------------------------------------------------------------------------------------


def test_same_seed_same_sequence_different_seed_different():
    steps = [torch.randn(200) for _ in range(40)]

    def run(**params) -> list[int]:
        return _generate(_state(**params), steps, row=0, companions=[])

    assert run(seed=11) == run(seed=11)
    assert run(seed=11) != run(seed=12)
    assert run() != run()  # unseeded requests own independent generators


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_is_independent_of_its_row_and_companions(device):
    params = dict(seed=1234, temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, repetition_penalty=1.1)
    steps = [torch.randn(300, device=device) * 2 for _ in range(50)]
    alone = _generate(_state(**params), steps, row=0, companions=[])
    companions = [
        _state(seed=7, temperature=1.3),
        _state(temperature=0.0),
        _state(top_p=0.5, presence_penalty=1.0),
        _state(seed=1234, temperature=0.5),  # same seed, different params: must not share a stream
        _state(min_p=0.2, logprobs=3),
        _state(top_k=5, frequency_penalty=-1.0),
        _state(seed=99),
    ]
    in_batch = _generate(_state(**params), steps, row=5, companions=companions)
    assert in_batch == alone
    assert len(set(alone)) > 10  # really sampling, not collapsing to one token


@pytest.mark.parametrize("device", DEVICES)
def test_draws_do_not_depend_on_the_device(device):
    steps = [torch.randn(300) * 2 for _ in range(30)]
    on_cpu = _generate(_state(seed=5, top_k=50), steps, row=0, companions=[])
    on_device = _generate(_state(seed=5, top_k=50), [s.to(device) for s in steps], row=0, companions=[])
    assert on_device == on_cpu


def test_noise_drawn_on_threads_equals_noise_drawn_in_order():
    def generators() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(seed) for seed in range(6)]

    with ThreadPoolExecutor(4) as pool:
        threaded = exponential_noise(generators(), 1000, pool)
    in_order = exponential_noise(generators(), 1000)
    assert torch.equal(threaded, in_order)
    assert (in_order > 0).all() and abs(in_order.mean().item() - 1.0) < 0.02  # Exp(1) has mean 1


def test_sampler_mutates_neither_logits_nor_states():
    logits = torch.randn(2, 20)
    states = [_state(prompt=[1, 2], repetition_penalty=1.5, min_tokens=3, seed=1), _state(temperature=0.0)]
    states[0].output_token_ids = [4, 4]
    before_logits = logits.clone()
    before_states = copy.deepcopy([(s.prompt_token_ids, s.output_token_ids) for s in states])
    Sampler()(logits, states)
    assert torch.equal(logits, before_logits)
    assert [(s.prompt_token_ids, s.output_token_ids) for s in states] == before_states


# --------------------------------------------------------------------------------------------
# Logprobs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_come_from_raw_logits_and_top_n_is_sorted(device):
    logits = torch.randn(3, 40, device=device) * 3
    states = [
        _state(logprobs=5, temperature=0.5, repetition_penalty=1.5, prompt=[1, 2, 3], seed=0),
        _state(logprobs=0, seed=1),
        _state(seed=2),
    ]
    outputs = Sampler()(logits, states)
    expected = torch.log_softmax(logits.cpu(), dim=-1)
    first = outputs[0]
    assert math.isclose(first.logprobs[0], expected[0, first.token_ids[0]].item(), abs_tol=1e-5)
    top = first.top_logprobs[0]
    assert [token_id for token_id, _ in top] == expected[0].topk(5).indices.tolist()
    assert all(math.isclose(value, expected[0, token_id].item(), abs_tol=1e-5) for token_id, value in top)
    assert [value for _, value in top] == sorted((value for _, value in top), reverse=True)
    assert math.isclose(outputs[1].logprobs[0], expected[1, outputs[1].token_ids[0]].item(), abs_tol=1e-5)
    assert outputs[1].top_logprobs == [[]]
    assert outputs[2].logprobs is None and outputs[2].top_logprobs is None


def test_logits_of_wrong_shape_are_rejected():
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, 10), [_state()])
