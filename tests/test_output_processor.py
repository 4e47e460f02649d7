"""The output processor on its own: stop rules, incremental text and stop strings, the outputs handed out.

Expected texts come from full decodes of the token ids (``Tokenizer.decode``), never from the processor itself.
"""

from __future__ import annotations

import pytest

from dsinfer.engine.detokenizer import REPLACEMENT_CHAR
from dsinfer.engine.output_processor import (
    CompletionText,
    ReportedCompletion,
    completion_output,
    cut_at_stop_string,
    finish_reason_after_token,
    request_output,
)
from dsinfer.engine.outputs import RequestMetrics
from dsinfer.engine.sequence import Sequence
from dsinfer.sampling.sampler import make_sampling_state
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

SENTENCE = "Hello, world! The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return Tokenizer.from_dir(tiny_checkpoint)


def _first_prefix_containing(tokenizer, ids, needle):
    """How many leading ids a full decode needs before it holds ``needle``."""
    return next(k for k in range(1, len(ids) + 1) if needle in tokenizer.decode(ids[:k]))


def _feed_one_by_one(text: CompletionText, ids: list[int]) -> int | None:
    """Feed ids one at a time; the count fed when a stop string matched (None if never)."""
    for count in range(1, len(ids) + 1):
        if text.update(ids[:count], hide_last=False, finish_reason=None):
            return count
    return None


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_token_boundaries_is_found_when_its_last_piece_arrives(tokenizer, include):
    ids = tokenizer.encode(SENTENCE)
    stop = "quick brown f"
    needed = _first_prefix_containing(tokenizer, ids, stop)
    assert tokenizer.decode(ids[needed - 1 : needed]) != stop  # the stop string spans several tokens
    text = CompletionText(tokenizer, SamplingParams(stop=[stop], include_stop_str_in_output=include))
    assert _feed_one_by_one(text, ids) == needed
    head = SENTENCE[: SENTENCE.index(stop)]
    assert text.text == (head + stop if include else head)


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode(SENTENCE)
    text = CompletionText(tokenizer, SamplingParams(stop=["lazy", "fox", "brown"]))
    text.update(ids, hide_last=False, finish_reason=None)
    assert text.text == SENTENCE[: SENTENCE.index("brown")]


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode(SENTENCE)
    early = _first_prefix_containing(tokenizer, ids, "Hello")
    text = CompletionText(tokenizer, SamplingParams(stop=["Hello", "lazy"], min_tokens=early + 1, max_tokens=64))
    matched_at = _feed_one_by_one(text, ids)
    # "Hello" is out before min_tokens and never searched again; "lazy" ends it.
    assert matched_at == _first_prefix_containing(tokenizer, ids, "lazy")
    assert text.text == SENTENCE[: SENTENCE.index("lazy")]


def test_a_hidden_stop_token_stays_out_and_a_token_stop_leaves_the_text_whole(tokenizer):
    ids = tokenizer.encode(SENTENCE)
    text = CompletionText(tokenizer, SamplingParams(stop=["fox"]))
    assert not text.update(ids, hide_last=True, finish_reason="stop")  # ended by a stop token: no stop strings
    assert text.text == tokenizer.decode(ids[:-1])


def test_a_stop_string_with_the_last_allowed_token_is_reported(tokenizer):
    ids = tokenizer.encode(SENTENCE)
    needed = _first_prefix_containing(tokenizer, ids, "fox")
    for reason, matches in (("length", True), ("abort", False)):
        text = CompletionText(tokenizer, SamplingParams(stop=["fox"]))
        assert text.update(ids[:needed], hide_last=False, finish_reason=reason) is matches
        whole = tokenizer.decode(ids[:needed])
        assert text.text == (whole[: whole.index("fox")] if matches else whole)


def test_a_split_character_is_held_back_then_completed_or_flushed(tokenizer):
    ids = tokenizer.encode("go 🚀 now")
    rocket = next(k for k in range(1, len(ids) + 1) if tokenizer.decode(ids[:k]).endswith(REPLACEMENT_CHAR))
    running = CompletionText(tokenizer, SamplingParams())
    assert _feed_one_by_one(running, ids[:rocket]) is None
    assert running.text == tokenizer.decode(ids[: rocket - 1])  # the token with the character's first bytes waits
    assert REPLACEMENT_CHAR not in running.text
    running.update(ids, hide_last=False, finish_reason=None)
    assert running.text == "go 🚀 now"
    ended = CompletionText(tokenizer, SamplingParams())
    assert _feed_one_by_one(ended, ids[: rocket - 1]) is None
    ended.update(ids[:rocket], hide_last=False, finish_reason="length")
    assert ended.text == tokenizer.decode(ids[:rocket])  # what a full decode gives: the bytes as U+FFFD


def test_a_stop_string_inside_a_split_character_is_found_once_it_is_whole(tokenizer):
    ids = tokenizer.encode("go 🚀 now")
    text = CompletionText(tokenizer, SamplingParams(stop=["🚀"], include_stop_str_in_output=True))
    assert _feed_one_by_one(text, ids) == _first_prefix_containing(tokenizer, ids, "🚀")
    assert text.text == "go 🚀"


def test_no_text_without_detokenize(tokenizer):
    text = CompletionText(tokenizer, SamplingParams(detokenize=False))
    assert not text.update(tokenizer.encode(SENTENCE), hide_last=False, finish_reason="length")
    assert text.text == ""


def test_cut_at_stop_string_searches_only_where_a_new_match_can_start():
    assert cut_at_stop_string("abcSTOPdef", ["STOP"], False, searched_from=0) == "abc"
    assert cut_at_stop_string("abcSTOPdef", ["STOP"], True, searched_from=5) == "abcSTOP"  # ends past 5: found
    assert cut_at_stop_string("abcSTOPdef", ["STOP"], False, searched_from=8) is None  # lies wholly before
    assert cut_at_stop_string("abc", ["", "z"], False, searched_from=0) is None  # empty stop strings never match


def _sequence(params: SamplingParams, eos: int = 0) -> Sequence:
    prompt = [5, 6, 7]
    return Sequence("r", 0, prompt, make_sampling_state(params, prompt, eos))


def _append(seq: Sequence, token: int, max_model_len: int = 100) -> str | None:
    seq.output_token_ids.append(token)
    return finish_reason_after_token(seq, max_model_len)


def test_token_stop_rules():
    seq = _sequence(SamplingParams(stop_token_ids=[9], max_tokens=10))
    assert _append(seq, 4) is None and not seq.hide_last_token
    assert _append(seq, 9) == "stop" and seq.hide_last_token
    eos_early = _sequence(SamplingParams(min_tokens=2, max_tokens=10))
    assert _append(eos_early, 0) is None and not eos_early.hide_last_token  # before min_tokens: an ordinary token
    assert _append(eos_early, 0) == "stop" and eos_early.hide_last_token
    ignoring = _sequence(SamplingParams(ignore_eos=True, max_tokens=2))
    assert _append(ignoring, 0) is None
    assert _append(ignoring, 0) == "length" and not ignoring.hide_last_token
    long = _sequence(SamplingParams(max_tokens=None))
    assert _append(long, 4, max_model_len=5) is None  # three prompt tokens and one output
    assert _append(long, 4, max_model_len=5) == "length"


def test_a_reported_completion_drops_what_the_engine_made_after_a_stop_string(tokenizer):
    ids = tokenizer.encode(SENTENCE)
    needed = _first_prefix_containing(tokenizer, ids, "fox")
    completion = ReportedCompletion(tokenizer, SamplingParams(stop=["fox"], logprobs=0), index=1)
    told = [completion.push(t, None, False, logprob=-float(i)) for i, t in enumerate(ids)]
    assert told == [i == needed - 1 for i in range(len(ids))]  # the engine process is told once
    out = completion.snapshot()
    assert (out.index, out.finish_reason, out.text) == (1, "stop", SENTENCE[: SENTENCE.index("fox")])
    assert out.token_ids == ids[:needed] and out.logprobs == [-float(i) for i in range(needed)]


def test_a_reported_completion_keeps_the_engines_end(tokenizer):
    ids = tokenizer.encode(SENTENCE)
    completion = ReportedCompletion(tokenizer, SamplingParams(stop=["never"]), index=0)
    for token in ids[:-1]:
        assert not completion.push(token, None, False)
    assert not completion.push(ids[-1], "stop", True)  # a hidden stop token ends it
    out = completion.snapshot()
    assert out.finish_reason == "stop" and out.text == tokenizer.decode(ids[:-1]) and out.token_ids == ids


def test_request_output_copies_and_is_finished_only_when_every_completion_is():
    tokens, logprobs = [1, 2], [-0.5, -0.25]
    done = completion_output(0, "ab", tokens, "stop", logprobs, None)
    running = completion_output(1, "a", tokens[:1], None, None, None)
    tokens.append(3)
    logprobs.append(-1.0)
    assert done.token_ids == [1, 2] and done.logprobs == [-0.5, -0.25] and done.top_logprobs is None
    metrics = RequestMetrics(0.0, None, None, None)
    assert not request_output("r", [7], [done, running], metrics).finished
    assert request_output("r", [7], [done], metrics).finished


def test_a_stop_string_with_the_engines_last_token_needs_no_word_to_the_engine(tokenizer):
    ids = tokenizer.encode(SENTENCE)
    needed = _first_prefix_containing(tokenizer, ids, "fox")
    completion = ReportedCompletion(tokenizer, SamplingParams(stop=["fox"], max_tokens=needed), index=0)
    told = [completion.push(t, "length" if i == needed - 1 else None, False) for i, t in enumerate(ids[:needed])]
    assert not any(told)  # the engine process ended it already
    out = completion.snapshot()
    assert out.finish_reason == "stop" and out.text == SENTENCE[: SENTENCE.index("fox")]
