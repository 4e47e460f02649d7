"""engram_decode_rows: the reference against the hasher's decode step (the ids and the advanced histories), and the
Triton kernel (interpreted on the CPU; compiled on CUDA) against the reference: sequences at position 0 (no
look-back), dead ids inside the look-back, image tokens, n-gram sizes 2 to 4, one and two layers, head counts
that are and are not powers of two, one sequence and a shuffled batch of slots."""

from __future__ import annotations

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.engram.hashing import EngramHasher
from dsinfer.ops import registry
from dsinfer.ops.engram_rows.reference import ENGRAM_DEAD, EngramRowHashing, engram_decode_rows_reference

VOCAB, COMPRESSED = 300, 97
CASES = [(1, (1,), 4, 2, None), (6, (1, 6), 4, 3, 299), (5, (2,), 3, 8, 299), (4, (0, 3), 2, 5, None)]


def make_hasher(layers, ngram, heads, image_token_id) -> EngramHasher:
    table = torch.arange(VOCAB) % COMPRESSED
    return EngramHasher(table, engram_layer_ids=layers, engram_vocab_size=1000, engram_max_ngram_size=ngram,
                        engram_n_heads=heads, engram_pad_id=2, engram_compressed_vocab_size=COMPRESSED,
                        image_token_id=image_token_id)  # fmt: skip


def make_step(batch, ngram, generator):
    """Token ids, a history pool with a few dead ids, shuffled slots and starts (some 0)."""
    slots_count = batch + 3
    history = torch.randint(0, COMPRESSED, (slots_count, ngram - 1), generator=generator)
    history[torch.rand(history.shape, generator=generator) < 0.2] = ENGRAM_DEAD
    tokens = torch.randint(0, VOCAB, (batch,), generator=generator)
    tokens[::3] = VOCAB - 1  # the image token where the case has one
    starts = torch.randint(0, 3, (batch,), generator=generator)
    return tokens, history, torch.randperm(slots_count, generator=generator)[:batch], starts


def op_args(hasher: EngramHasher, tokens, history, slots, starts):
    hashing = EngramRowHashing(hasher.compressed_vocabulary, hasher.image_token_id, hasher.pad_compressed_id,
                               hasher._multipliers, hasher._primes, hasher._offsets)  # fmt: skip
    return tokens, history, slots, starts, hashing


def check(device: torch.device) -> list[str]:
    import dsinfer.ops.engram_rows.triton as backend

    failures = []
    generator = torch.Generator().manual_seed(0)
    for batch, layers, ngram, heads, image in CASES:
        hasher = make_hasher(layers, ngram, heads, image).to(device)
        tokens, history, slots, starts = (t.to(device) for t in make_step(batch, ngram, generator))
        want_history, got_history = history.clone(), history.clone()
        want = engram_decode_rows_reference(*op_args(hasher, tokens, want_history, slots, starts))
        got = backend.engram_decode_rows_triton(*op_args(hasher, tokens, got_history, slots, starts))
        label = f"batch={batch} layers={layers} n={ngram} heads={heads} image={image}"
        if not torch.equal(got, want):
            failures.append(f"{label}: rows differ")
        if not torch.equal(got_history, want_history):
            failures.append(f"{label}: histories differ")
    return failures


def run_interpreted_cases() -> list[str]:
    return check(torch.device("cpu"))


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_reference_is_the_hashers_decode_step(case):
    batch, layers, ngram, heads, image = case
    hasher = make_hasher(layers, ngram, heads, image)
    tokens, history, slots, starts = make_step(batch, ngram, torch.Generator().manual_seed(1))
    fresh = (starts == 0)[:, None]
    contexts = torch.where(fresh, torch.full_like(history[slots], ENGRAM_DEAD), history[slots])
    want_rows, want_next = hasher.decode_step(tokens, contexts)
    advanced = history.clone()
    rows = engram_decode_rows_reference(*op_args(hasher, tokens, advanced, slots, starts))
    assert torch.equal(rows, want_rows)
    assert torch.equal(advanced[slots], want_next)
    untouched = torch.ones(history.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(advanced[untouched], history[untouched])


def test_triton_kernel_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_engram_rows")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernel_matches_the_reference_on_cuda():
    assert check(torch.device("cuda")) == []


def test_registry_picks_the_kernel_on_cuda_only():
    assert [b.name for b in registry.backends("engram_decode_rows")] == ["triton", "reference"]
    assert registry.choose("engram_decode_rows", "cpu", torch.float32).name == "reference"
