"""Tests for the counter-based noise in dsinfer.sampling.noise: known answers, devices, statistics."""

from __future__ import annotations

import math

import pytest
import torch

from dsinfer.sampling.noise import (
    ACCEPT_STREAM,
    RACE_STREAM,
    as_int64,
    exponentials,
    key_tensor,
    mix64,
    noise_key,
    race,
    uniform_bits,
    uniforms,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# SplitMix64's published outputs (Vigna's splitmix64.c; Rosetta Code "Pseudo-random numbers/Splitmix64").
SPLITMIX64_SEED_1234567 = [
    6457827717110365317,
    3203168211198807973,
    9817491932198370423,
    4593380528125082431,
    16408922859458223821,
]
SPLITMIX64_SEED_0 = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


class SplitMix64:
    """A second, independent SplitMix64: the stateful generator as published (uint64 state, Weyl increment)."""

    def __init__(self, state: int) -> None:
        self.state = state % 2**64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) % 2**64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)


def _keys(values: list[int], device) -> torch.Tensor:
    return torch.tensor([as_int64(value) for value in values], dtype=torch.int64, device=device)


def test_the_second_implementation_gives_the_published_outputs():
    one, zero = SplitMix64(1234567), SplitMix64(0)
    assert [one.next() for _ in range(5)] == SPLITMIX64_SEED_1234567
    assert [zero.next() for _ in range(3)] == SPLITMIX64_SEED_0


@pytest.mark.parametrize("device", DEVICES)
def test_column_bits_are_the_top_bits_of_the_published_splitmix64_stream(device):
    bits = uniform_bits(_keys([1234567, 0], device), 5).cpu()
    assert bits[0].tolist() == [value >> 40 for value in SPLITMIX64_SEED_1234567]
    assert bits[1, :3].tolist() == [value >> 40 for value in SPLITMIX64_SEED_0]


@pytest.mark.parametrize("device", DEVICES)
def test_device_bits_equal_the_pure_python_stream_for_random_keys(device):
    generator = torch.Generator().manual_seed(3)
    keys = [int(k) for k in torch.randint(0, 2**62, (6,), generator=generator)] + [2**64 - 1, 2**63, 2**63 - 1]
    keys = [k * 3 % 2**64 for k in keys]  # spread over the full 64-bit range, negative int64 included
    vocab_size = 777
    assert torch.equal(key_tensor(keys, device), _keys(keys, device))
    bits = uniform_bits(_keys(keys, device), vocab_size).cpu()
    for row, key in enumerate(keys):
        stream = SplitMix64(key)
        assert bits[row].tolist() == [stream.next() >> 40 for _ in range(vocab_size)]


def test_row_keys_fold_each_part_in_turn():
    def reference(seed: int, sample_index: int, position: int, stream: int) -> int:
        key = seed % 2**64
        for part in (stream, sample_index, position):
            key = mix64(((key ^ (part % 2**64)) + 0x9E3779B97F4A7C15) % 2**64)
        return key

    for seed, index, position, stream in [(0, 0, 0, 0), (-5, 2, 7, 1), (2**70 + 3, 1, 10**6, 0)]:
        assert noise_key(seed, index, position, stream) == reference(seed, index, position, stream)
    assert noise_key(-1, 0, 0) == noise_key(2**64 - 1, 0, 0)  # seeds wrap modulo 2**64
    parts = [(1, 0, 0, 0), (2, 0, 0, 0), (1, 1, 0, 0), (1, 0, 1, 0), (1, 0, 0, 1), (0, 1, 0, 0), (0, 0, 1, 0)]
    assert len({noise_key(*p) for p in parts}) == len(parts)  # every part changes the key


def test_mix64_is_splitmix64s_finaliser():
    assert mix64(0x9E3779B97F4A7C15) == SPLITMIX64_SEED_0[0]
    assert mix64(1234567 + 0x9E3779B97F4A7C15) == SPLITMIX64_SEED_1234567[0]


@pytest.mark.parametrize("device", DEVICES)
def test_uniforms_are_exact_multiples_of_two_to_the_minus_24_in_unit_interval(device):
    keys = _keys([noise_key(seed, 0, 0) for seed in range(8)], device)
    values = uniforms(keys, 5000)
    bits = uniform_bits(keys, 5000)
    assert values.dtype == torch.float32
    assert torch.equal(values * 2**24, bits.float())
    assert (values >= 0).all() and (values < 1).all()


def test_uniform_bits_are_uniform_and_rows_are_uncorrelated():
    keys = _keys([noise_key(7, 0, position) for position in range(64)], "cpu")
    values = uniforms(keys, 4096).double()
    counts = torch.histc(values, bins=64, min=0.0, max=1.0)
    expected = values.numel() / 64
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 110.0  # 63 degrees of freedom, p ~ 0.0002
    centred = values - 0.5
    correlation = (centred[:-1] * centred[1:]).mean(dim=1) / centred.var()
    assert correlation.abs().max().item() < 0.08  # neighbouring positions: independent (|r| ~ 1/64 by chance)
    lag_one = (centred[:, :-1] * centred[:, 1:]).mean() / centred.var()
    assert abs(lag_one.item()) < 0.01  # neighbouring columns too


@pytest.mark.parametrize("device", DEVICES)
def test_exponentials_have_mean_and_variance_one(device):
    keys = _keys([noise_key(11, index, 3) for index in range(16)], device)
    noise = exponentials(keys, 20000).double()
    finite = noise[torch.isfinite(noise)]
    assert finite.numel() >= noise.numel() - 2  # u == 0 (inf) has probability 2**-24 per value
    assert abs(finite.mean().item() - 1.0) < 0.01 and abs(finite.var().item() - 1.0) < 0.03


def test_streams_and_sample_indices_give_different_noise():
    base = noise_key(5, 0, 9, RACE_STREAM)
    others = [noise_key(5, 0, 9, ACCEPT_STREAM), noise_key(5, 1, 9), noise_key(5, 0, 10), noise_key(6, 0, 9)]
    rows = uniforms(_keys([base, *others], "cpu"), 1000)
    for row in range(1, rows.shape[0]):
        assert (rows[0] == rows[row]).float().mean().item() < 0.01


@pytest.mark.parametrize("device", DEVICES)
def test_race_draws_follow_the_normalised_probabilities(device):
    probs = torch.tensor([0.5, 0.0, 1.5, 0.25, 0.75, 1.0])  # unnormalised; a zero never wins
    draws = 30000
    keys = _keys([noise_key(seed, 0, 0) for seed in range(draws)], device)
    tokens = race(probs.to(device).expand(draws, -1).contiguous(), keys).cpu()
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[1] == 0
    expected = probs.double() / probs.sum() * draws
    nonzero = expected > 0
    chi_square = ((counts[nonzero] - expected[nonzero]) ** 2 / expected[nonzero]).sum().item()
    assert chi_square < 20.5  # 4 degrees of freedom, p = 0.0004


def test_cpu_race_in_chunks_equals_one_pass():
    generator = torch.Generator().manual_seed(1)
    probs = torch.rand(11, 300, generator=generator)
    keys = _keys([noise_key(seed, 0, 4) for seed in range(11)], "cpu")
    one_pass = (probs / exponentials(keys, 300)).argmax(dim=-1)
    assert torch.equal(race(probs, keys), one_pass)
    assert torch.equal(race(probs[5:6], keys[5:6]), one_pass[5:6])  # a row alone draws what it draws in a batch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU to compare against")
def test_cuda_exponentials_match_cpu_to_a_float32_ulp():
    keys = [noise_key(seed, 0, 1) for seed in range(4)]
    on_cpu = exponentials(_keys(keys, "cpu"), 129280)
    on_cuda = exponentials(_keys(keys, "cuda"), 129280).cpu()
    finite = torch.isfinite(on_cpu)
    assert torch.equal(finite, torch.isfinite(on_cuda))
    assert torch.allclose(on_cuda[finite], on_cpu[finite], rtol=2 * 2**-23, atol=0.0)
    assert math.isclose(on_cpu[finite].double().mean().item(), 1.0, abs_tol=0.01)
