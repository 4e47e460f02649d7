"""Engram hashing (token ids -> table rows) and the compressed vocabulary of DeepSeek-V4.1."""

from __future__ import annotations

import numpy as np
import pytest
import tokenizers
import torch

from dsinfer.engram import (
    ENGRAM_DEAD,
    EngramContext,
    EngramHasher,
    build_compressed_vocabulary,
    compressed_key,
    engram_normalizer,
    engram_primes,
    hash_multipliers,
    is_prime,
)
from dsinfer.models.tiny_tokenizer import build_tiny_tokenizer
from dsinfer.tokenizer import Tokenizer

# The released DeepSeek-V4.1-Flash configuration.
REAL = dict(
    engram_layer_ids=[1, 14],
    engram_vocab_size=16_000_000,
    engram_max_ngram_size=4,
    engram_n_heads=8,
    engram_pad_id=2,
    engram_compressed_vocab_size=99_092,
    image_token_id=129_264,
)
IMAGE = REAL["image_token_id"]


def _trial_division_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))


def _real_hasher(seed: int = 0) -> EngramHasher:
    """Real hash geometry over a random many-to-one token map (129,280 ids -> 99,092)."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.cat([torch.arange(99_092), torch.randint(0, 99_092, (129_280 - 99_092,), generator=generator)])
    return EngramHasher(table, **REAL)


@pytest.fixture(scope="module")
def real_hasher() -> EngramHasher:
    return _real_hasher()


# --------------------------------------------------------------------------- primes and table sizes
def test_real_table_sizes_match_the_checkpoint(real_hasher):
    primes = engram_primes(2, 16_000_000, 4, 8)
    assert [sum(p for per_n in layer for p in per_n) for layer in primes] == [384_006_168, 384_016_682]
    assert real_hasher.table_sizes() == {1: 384_006_168, 14: 384_016_682}
    assert real_hasher.primes(1).shape == (3, 8) and real_hasher.offsets(14).shape == (24,)


def test_primes_are_the_consecutive_primes_from_engram_vocab_size():
    flat = [p for layer in engram_primes(2, 16_000_000, 4, 8) for per_n in layer for p in per_n]
    expected, candidate = [], 16_000_000
    while len(expected) < 48:  # independent: trial division, no skipping
        if _trial_division_prime(candidate):
            expected.append(candidate)
        candidate += 1
    assert flat == expected
    assert all(a < b for a, b in zip(flat, flat[1:], strict=False)) and len(set(flat)) == 48
    assert flat[0] == 16_000_057 and flat[-1] == 16_000_889


def test_primes_follow_the_reference_search_order():
    """The reference restarts each n-gram's search at engram_vocab_size - 1 and skips primes already taken."""

    def reference(num_layers, vocab, max_ngram, heads):
        seen, out = set(), []
        for _ in range(num_layers):
            per_layer = []
            for _ in range(max_ngram - 1):
                sizes, current = [], vocab - 1
                for _ in range(heads):
                    current += 1
                    while not _trial_division_prime(current) or current in seen:
                        current += 1
                    seen.add(current)
                    sizes.append(current)
                per_layer.append(sizes)
            out.append(per_layer)
        return out

    for args in [(3, 30, 4, 3), (2, 31, 3, 2), (1, 2, 5, 4), (2, 1000, 4, 8)]:
        assert engram_primes(*args) == reference(*args)
    assert engram_primes(1, 31, 2, 1) == [[[31]]]  # a prime engram_vocab_size is itself the first bucket


def test_is_prime_matches_trial_division():
    for n in [*range(-3, 5000), *range(16_000_000, 16_002_000), 561, 1_373_653, 25_326_001, 2**31 - 1]:
        assert is_prime(n) == _trial_division_prime(n), n
    assert is_prime(2**61 - 1) and not is_prime((2**31 - 1) * (2**61 - 1))


def test_offsets_restart_per_layer_and_tile_the_table(real_hasher):
    for layer in (1, 14):
        primes = real_hasher.primes(layer).flatten().tolist()
        offsets = real_hasher.offsets(layer).tolist()
        assert offsets[0] == 0
        assert offsets == [sum(primes[:i]) for i in range(24)]
        assert offsets[-1] + primes[-1] == real_hasher.table_sizes()[layer]


# --------------------------------------------------------------------------- multipliers
def test_multipliers_match_independently_published_values():
    # numpy default_rng(10007 * layer).integers(0, (2**63 - 1) // 99092 // 2, 4) as printed in the
    # tests of an independent C++ port of V4.1 (its numpy_rng_and_normaliser case), then * 2 + 1.
    assert hash_multipliers(1, 4, 99_092) == [
        2 * 38316048023122 + 1,
        2 * 2419938046656 + 1,
        2 * 17979836159674 + 1,
        2 * 36993668729195 + 1,
    ]
    layer14 = hash_multipliers(14, 4, 99_092)
    assert layer14[0] == 2 * 33858405369630 + 1 and layer14[3] == 2 * 41309613242795 + 1


def test_products_cannot_overflow_int64(real_hasher):
    for layer in (1, 14):
        multipliers = real_hasher.multipliers(layer).tolist()
        assert all(m % 2 == 1 and 0 < m <= (2**63 - 1) // 99_092 + 1 for m in multipliers)
        assert (99_092 - 1) * max(multipliers) < 2**63


# --------------------------------------------------------------------------- hand-checked rows
def test_hand_checked_rows_small_config():
    # 10 tokens -> 8 compressed ids; token 2 (the pad) compresses to 2.
    table = torch.tensor([0, 1, 2, 3, 1, 4, 5, 2, 6, 7])
    hasher = EngramHasher(
        table,
        engram_layer_ids=[1, 3],
        engram_vocab_size=30,
        engram_max_ngram_size=3,
        engram_n_heads=2,
        engram_pad_id=2,
        engram_compressed_vocab_size=8,
        image_token_id=None,
    )
    # Primes from 30: layer 1 takes 31 37 | 41 43, layer 3 takes 47 53 | 59 61.
    assert hasher.primes(1).tolist() == [[31, 37], [41, 43]]
    assert hasher.primes(3).tolist() == [[47, 53], [59, 61]]
    assert hasher.table_sizes() == {1: 31 + 37 + 41 + 43, 3: 47 + 53 + 59 + 61}

    bound = (2**63 - 1) // 8 // 2
    m1 = [int(x) * 2 + 1 for x in np.random.default_rng(10007).integers(0, bound, 3)]
    m3 = [int(x) * 2 + 1 for x in np.random.default_rng(3 * 10007).integers(0, bound, 3)]

    def rows(g, m, primes):  # g = [g0, g1, g2]; columns (n=2: heads 0, 1), (n=3: heads 0, 1)
        h2 = (g[0] * m[0]) ^ (g[1] * m[1])
        h3 = h2 ^ (g[2] * m[2])
        p = primes
        return [h2 % p[0], h2 % p[1] + p[0], h3 % p[2] + p[0] + p[1], h3 % p[3] + p[0] + p[1] + p[2]]

    tokens = torch.tensor([3, 5, 9])  # compressed 3, 4, 7
    expected_1 = [rows([3, 2, 2], m1, [31, 37, 41, 43]), rows([4, 3, 2], m1, [31, 37, 41, 43])]
    expected_1.append(rows([7, 4, 3], m1, [31, 37, 41, 43]))
    expected_3 = rows([7, 4, 3], m3, [47, 53, 59, 61])
    assert hasher.row_ids(tokens, None, 1).tolist() == expected_1
    assert hasher.row_ids(tokens, [3], 3)[2].tolist() == expected_3
    assert hasher.all_row_ids(tokens)[:, 0].tolist() == expected_1


def test_hand_checked_rows_real_config(real_hasher):
    table = real_hasher.compressed_vocabulary
    tokens = [17, 40_000, 129_000, 5, 123_456]
    g = [int(table[t]) for t in tokens]
    pad = int(table[2])
    primes = engram_primes(2, 16_000_000, 4, 8)[1]  # layer 14 is the second Engram layer
    m = hash_multipliers(14, 4, 99_092)
    got = real_hasher.row_ids(torch.tensor(tokens), [5], 14)
    for t, window in [(4, [g[4], g[3], g[2], g[1]]), (1, [g[1], g[0], pad, pad])]:
        hashes, rolling = [], window[0] * m[0]
        for n in range(1, 4):
            rolling ^= window[n] * m[n]
            hashes.append(rolling)
        offset, expected = 0, []
        for n in range(3):
            for head in range(8):
                expected.append(hashes[n] % primes[n][head] + offset)
                offset += primes[n][head]
        assert got[t].tolist() == expected


# --------------------------------------------------------------------------- packed batches, decode, images
def _python_rows(hasher: EngramHasher, sequences: list[list[int]], layer: int) -> list[list[int]]:
    """Plain-Python rows: one sequence at a time, look-back blocked at the start and at image tokens."""
    table = hasher.compressed_vocabulary.tolist()
    pad = table[2]
    index = hasher.layer_ids.index(layer)
    primes = engram_primes(len(hasher.layer_ids), 16_000_000, 4, 8)[index]
    m = hash_multipliers(layer, 4, 99_092)
    out = []
    for seq in sequences:
        for t in range(len(seq)):
            window, blocked = [], False
            for k in range(4):
                blocked = blocked or t - k < 0 or seq[t - k] == IMAGE
                window.append(pad if blocked else table[seq[t - k]])
            row, rolling, offset = [], window[0] * m[0], 0
            for n in range(1, 4):
                rolling ^= window[n] * m[n]
                for head in range(8):
                    row.append(rolling % primes[n - 1][head] + offset)
                    offset += primes[n - 1][head]
            out.append(row)
    return out


def _random_sequences(lengths, seed, image_rate=0.0):
    generator = np.random.default_rng(seed)
    sequences = []
    for length in lengths:
        seq = generator.integers(0, 129_280, size=length).tolist()
        sequences.append([IMAGE if generator.random() < image_rate else t for t in seq])
    return sequences


def test_packed_batch_matches_plain_python_and_each_sequence_alone(real_hasher):
    sequences = _random_sequences([1, 7, 3, 12, 2], seed=1, image_rate=0.2)
    packed = torch.tensor([t for seq in sequences for t in seq])
    lengths = [len(seq) for seq in sequences]
    for layer in (1, 14):
        rows = real_hasher.row_ids(packed, lengths, layer)
        assert rows.shape == (len(packed), 24) and rows.dtype == torch.int64
        assert rows.tolist() == _python_rows(real_hasher, sequences, layer)
        alone = torch.cat([real_hasher.row_ids(torch.tensor(seq), None, layer) for seq in sequences])
        assert torch.equal(rows, alone)
    all_rows = real_hasher.all_row_ids(packed, torch.tensor(lengths))
    assert torch.equal(all_rows[:, 1], real_hasher.row_ids(packed, lengths, 14))
    sizes = real_hasher.table_sizes()
    assert int(all_rows[:, 0].max()) < sizes[1] and int(all_rows[:, 1].max()) < sizes[14] and int(all_rows.min()) >= 0


def test_decode_continuation_equals_full_computation_at_every_step(real_hasher):
    sequences = _random_sequences([9, 6, 11], seed=2, image_rate=0.15)
    full = [real_hasher.all_row_ids(torch.tensor(seq)) for seq in sequences]
    contexts = [EngramContext.empty() for _ in sequences]
    for step in range(max(len(seq) for seq in sequences)):
        live = [i for i, seq in enumerate(sequences) if step < len(seq)]
        tokens = torch.tensor([sequences[i][step] for i in live])
        stacked = EngramContext.stack([contexts[i] for i in live])
        rows = real_hasher.all_row_ids(tokens, [1] * len(live), stacked)
        for j, i in enumerate(live):
            assert torch.equal(rows[j], full[i][step])
        advanced = real_hasher.next_contexts(tokens, [1] * len(live), stacked)
        for j, i in enumerate(live):
            contexts[i] = real_hasher.advance(contexts[i], [sequences[i][step]])
            assert contexts[i].history == tuple(advanced[j].tolist())
    table = real_hasher.compressed_vocabulary
    last = sequences[0][-3:]
    assert contexts[0].history == tuple(ENGRAM_DEAD if t == IMAGE else int(table[t]) for t in last)


def test_chunked_prefill_equals_one_shot(real_hasher):
    seq = _random_sequences([14], seed=3, image_rate=0.1)[0]
    full = real_hasher.row_ids(torch.tensor(seq), None, 1)
    for split in range(len(seq) + 1):
        first, second = torch.tensor(seq[:split], dtype=torch.int64), torch.tensor(seq[split:], dtype=torch.int64)
        context = real_hasher.next_contexts(first, [split])
        rows = torch.cat([real_hasher.row_ids(first, [split], 1), real_hasher.row_ids(second, None, 1, context)])
        assert torch.equal(rows, full)
    # A packed batch mixing a fresh prompt, a continuing chunk and a zero-length entry.
    other = _random_sequences([5], seed=4)[0]
    context = EngramContext.stack([EngramContext.empty(), real_hasher.advance(EngramContext.empty(), seq[:6])])
    context = torch.cat([context, EngramContext.stack([EngramContext.empty()])])
    packed = torch.tensor(other + seq[6:])
    rows = real_hasher.row_ids(packed, [5, len(seq) - 6, 0], 1, context)
    assert torch.equal(rows[:5], real_hasher.row_ids(torch.tensor(other), None, 1))
    assert torch.equal(rows[5:], full[6:])
    after = real_hasher.next_contexts(packed, [5, len(seq) - 6, 0], context)
    assert after[2].tolist() == [ENGRAM_DEAD] * 3


def test_pad_id_fills_the_lookback_at_sequence_start(real_hasher):
    table = real_hasher.compressed_vocabulary
    pad = int(table[2])
    seq = torch.tensor([1000, 2000, 3000, 4000, 5000])
    lookback = real_hasher.lookback_ids(seq)
    c = [int(table[t]) for t in seq.tolist()]
    assert lookback[:4].tolist() == [[c[0], pad, pad, pad], [c[1], c[0], pad, pad], [c[2], c[1], c[0], pad], c[3::-1]]
    # The pad token itself hashes like the start: [pad token, x] at x equals a fresh x.
    started = real_hasher.row_ids(torch.tensor([2, 2, 2, 777]), None, 1)[3]
    assert torch.equal(started, real_hasher.row_ids(torch.tensor([777]), None, 1)[0])
    # Empty context == no context.
    empty = EngramContext.stack([EngramContext.empty()])
    assert torch.equal(real_hasher.row_ids(seq, [5], 14, empty), real_hasher.row_ids(seq, [5], 14))


def test_image_token_blocks_the_lookback_and_shuts_the_gate(real_hasher):
    seq = _random_sequences([12], seed=5)[0]
    with_image = list(seq)
    with_image[5] = IMAGE
    plain = real_hasher.row_ids(torch.tensor(seq), None, 1)
    rows = real_hasher.row_ids(torch.tensor(with_image), None, 1)
    assert torch.equal(rows[:5], plain[:5])
    assert all(not torch.equal(rows[t], plain[t]) for t in range(5, 9))
    assert torch.equal(rows[9:], plain[9:])
    pad = int(real_hasher.compressed_vocabulary[2])
    lookback = real_hasher.lookback_ids(torch.tensor(with_image))
    assert lookback[5].tolist() == [pad] * 4  # an image token hashes as all pad
    assert lookback[7].tolist()[2:] == [pad, pad]  # blocked at the image and beyond
    assert real_hasher.gate_mask(torch.tensor(with_image)).tolist() == [t != 5 for t in range(12)]
    assert real_hasher.advance(EngramContext.empty(), with_image[:7]).history[1] == ENGRAM_DEAD
    # With image handling off, the image token id is an ordinary token.
    no_images = EngramHasher(real_hasher.compressed_vocabulary, **{**REAL, "image_token_id": None})
    assert torch.equal(no_images.row_ids(torch.tensor(with_image), None, 1)[9:], rows[9:])
    assert not torch.equal(no_images.row_ids(torch.tensor(with_image), None, 1)[5:9], rows[5:9])


def test_bad_arguments_raise_clear_errors(real_hasher):
    tokens = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="seq_lens"):
        real_hasher.row_ids(tokens, [2, 2], 1)
    with pytest.raises(ValueError, match="contexts must have shape"):
        real_hasher.row_ids(tokens, [3], 1, torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="context entries"):
        real_hasher.row_ids(tokens, [3], 1, torch.tensor([[0, 0, 99_092]]))
    with pytest.raises(ValueError, match="layer 2 has no Engram table"):
        real_hasher.row_ids(tokens, None, 2)
    with pytest.raises(ValueError, match="token ids must lie"):
        real_hasher.row_ids(torch.tensor([129_280]), None, 1)
    with pytest.raises(ValueError, match="1-D"):
        real_hasher.row_ids(tokens.view(1, 3), None, 1)
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        EngramHasher(torch.arange(10), **REAL)
    with pytest.raises(ValueError, match="engram_pad_id"):
        EngramHasher(torch.arange(2), **{**REAL, "engram_compressed_vocab_size": 2})
    with pytest.raises(ValueError, match="engram_layer_ids"):
        EngramHasher(torch.arange(99_092), **{**REAL, "engram_layer_ids": [1, 1]})


# --------------------------------------------------------------------------- compressed vocabulary
def test_compressed_key_normalisation_cases():
    normalizer = engram_normalizer()
    cases = {
        " The": "the",
        "THE\n": "the",
        "Café": "cafe",
        "naïve Ångström": "naive angstrom",
        "ｆｕｌｌ": "full",  # NFKC folds full-width forms
        "ﬁ": "fi",
        "a \t\r\n b": "a b",  # whitespace runs collapse to one space
        "\u00a0x": "x",  # NFKC turns no-break space into a space, then strip
        " ": " ",  # the lone space survives through the sentinel...
        "\n\n": " ",  # ...and every whitespace-only text becomes it
        "\t": " ",
        "\u0301": "\u0301",  # normalises to nothing: keyed by its raw text
        "": "",
    }
    for text, key in cases.items():
        assert compressed_key(text, "RAW", normalizer) == key, text
    assert compressed_key("\ufffd", "Ã", normalizer) == "Ã"  # U+FFFD: the raw token string
    assert compressed_key("ab\ufffd", "abÃ", normalizer) == "abÃ"
    assert compressed_key("\ufffd", None, normalizer) is None


class _ListTokenizer:
    """A minimal tokenizer with the dsinfer Tokenizer interface (decode / id_to_token / vocab_size)."""

    def __init__(self, pieces: list[tuple[str, str]]):
        self.pieces = pieces  # (decoded text, raw token string)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def decode(self, ids, skip_special_tokens=False):
        assert not skip_special_tokens
        return "".join(self.pieces[i][0] for i in ids)

    def id_to_token(self, token_id):
        return self.pieces[token_id][1]


def test_compressed_vocabulary_groups_in_first_seen_order():
    pieces = [
        ("<s>", "<s>"),
        (" The", "ĠThe"),
        ("the", "the"),
        ("THE", "THE"),
        ("café", "cafÃ©"),
        ("cafe", "cafe"),
        (" ", "Ġ"),
        ("  ", "ĠĠ"),
        ("\n", "Ċ"),
        ("\ufffd", "Ã"),
        ("\ufffd", "xyz"),
        ("x", "x"),
        ("XYZ", "XYZ"),  # normalises to the raw key of id 10: one key space, as in the reference
    ]
    table = build_compressed_vocabulary(_ListTokenizer(pieces), expected_size=7)
    assert table.dtype == torch.int64
    assert table.tolist() == [0, 1, 1, 1, 2, 2, 3, 3, 3, 4, 5, 6, 5]
    with pytest.raises(ValueError, match="yields 7 compressed Engram ids but engram_compressed_vocab_size is 8"):
        build_compressed_vocabulary(_ListTokenizer(pieces), expected_size=8)


@pytest.fixture(scope="module")
def tiny_tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engram-tokenizer")
    build_tiny_tokenizer(path, vocab_size=512)
    return path


def test_compressed_vocabulary_of_a_real_tokenizer(tiny_tokenizer_dir):
    raw = tokenizers.Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    table = build_compressed_vocabulary(raw)
    assert table.shape == (512,)
    # The dsinfer wrapper and a Hugging-Face-style object (backend_tokenizer + len) give the same map.
    assert torch.equal(build_compressed_vocabulary(Tokenizer.from_dir(tiny_tokenizer_dir)), table)

    class _HFStyle:
        backend_tokenizer = raw

        def __len__(self):
            return 512

    assert torch.equal(build_compressed_vocabulary(_HFStyle()), table)

    def cid(token: str) -> int:
        token_id = raw.token_to_id(token)
        assert token_id is not None, token
        return int(table[token_id])

    assert cid("Ġthe") == cid("The")  # case and leading space
    assert cid("Ã©") == cid("e")  # "é": accent stripped
    assert cid("Ġ") == cid("ĠĠ") == cid("Ċ") == cid("ĉ") == cid("č")  # whitespace-only tokens
    assert cid("Ġ") != cid("!")
    assert cid("·") != cid("¸")  # partial UTF-8 bytes decode to U+FFFD: keyed by their raw token
    assert len({cid(t) for t in ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<think>"]}) == 3
    # First-seen order: id 0 gets 0, and each new id is one more than any seen before.
    running_max = -1
    for value in table.tolist():
        assert value <= running_max + 1
        running_max = max(running_max, value)
    size = running_max + 1
    assert size == len(set(table.tolist())) < 512

    config = {**REAL, "engram_compressed_vocab_size": size, "image_token_id": raw.token_to_id("<｜image｜>")}
    hasher = EngramHasher.from_tokenizer(raw, **config)
    assert torch.equal(hasher.compressed_vocabulary, table)
    assert hasher.pad_compressed_id == int(table[2])
    with pytest.raises(ValueError, match="does not belong to the checkpoint"):
        EngramHasher.from_tokenizer(raw, **{**config, "engram_compressed_vocab_size": size + 1})


def test_the_forwards_prefill_step_gives_the_rows_and_contexts_of_the_checked_calls(real_hasher):
    """One pass, no range checks (the engine checked the ids where they entered), the same integers."""
    tokens = torch.tensor([5, 6, 7, 8, 9, 10])
    contexts = EngramContext.stack(
        [EngramContext.empty(), real_hasher.advance(EngramContext.empty(), [1, 2, 3]), EngramContext.empty()]
    )
    for lengths in ([2, 4, 0], [0, 1, 5], [6, 0, 0]):
        ends = torch.tensor(lengths).cumsum(0)
        for sequence_ends in (None, ends):
            rows, after = real_hasher.prefill_step(tokens, lengths, contexts, sequence_ends)
            assert torch.equal(rows, real_hasher.all_row_ids(tokens, lengths, contexts))
            assert torch.equal(after, real_hasher.next_contexts(tokens, lengths, contexts))
