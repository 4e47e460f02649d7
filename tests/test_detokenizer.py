"""Incremental detokenization gives exactly the text a full decode gives, without quadratic work."""

from __future__ import annotations

import random

import pytest

from dsinfer.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from dsinfer.tokenizer import Tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "深度求索的模型在长上下文里也能算对每一个词。",
    "emoji 🙂🚀 and accents: naïve café, Ωμέγα — “quotes”.",
    "  leading spaces\n\ttabs and\nnew lines  ",
]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return Tokenizer.from_dir(tiny_checkpoint)


def _incremental(tokenizer, ids, chunks, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    pieces, at = [], 0
    for size in chunks:
        piece = detok.push(ids[at : at + size])
        assert not piece.endswith(REPLACEMENT_CHAR)  # unfinished characters are held back
        pieces.append(piece)
        at += size
    pieces.append(detok.flush())
    return "".join(pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    assert _incremental(tokenizer, ids, [1] * len(ids)) == tokenizer.decode(ids, skip_special_tokens=True) == text


def test_random_ids_and_random_chunks_equal_full_decode(tokenizer):
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    for _ in range(30):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randrange(1, 5)))
            left -= chunks[-1]
        for skip in (True, False):
            assert _incremental(tokenizer, ids, chunks, skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_split_character_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) >= 2  # the byte-level tokenizer splits this character over several tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[:1]) == ""
    assert detok.push(ids[1:]) == "🚀"
    assert detok.flush() == ""


def test_an_unfinished_character_at_the_end_flushes_as_a_full_decode_does(tokenizer):
    ids = tokenizer.encode("ok 🚀")
    partial = ids[:-1]
    detok = IncrementalDetokenizer(tokenizer)
    text = detok.push(partial) + detok.flush()
    assert text == tokenizer.decode(partial, skip_special_tokens=True)


def test_without_detokenize_the_engine_keeps_no_text_and_the_same_tokens(tiny_v4_model, tokenizer):
    """``detokenize=False`` (the chat server, which parses the ids itself): same tokens, no text kept; stop
    strings, which are matched in the text, are refused with it."""
    from dsinfer.config import EngineConfig
    from dsinfer.engine.engine import LLMEngine
    from dsinfer.sampling_params import SamplingParams

    runs = {}
    for detokenize in (True, False):
        engine = LLMEngine(tiny_v4_model, tokenizer, EngineConfig(max_num_seqs=2, max_model_len=128))
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=detokenize)
        engine.add_request([5, 6, 7, 8], params, request_id="r")
        final = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                final = output
        engine.close()
        assert final is not None and final.finished
        runs[detokenize] = final.outputs[0]
    assert runs[True].token_ids == runs[False].token_ids and len(runs[False].token_ids) == 12
    assert runs[True].text == tokenizer.decode(runs[True].token_ids, skip_special_tokens=True) != ""
    assert runs[False].text == ""
    with pytest.raises(ValueError, match="need detokenize=True"):
        SamplingParams(stop=["."], detokenize=False)
