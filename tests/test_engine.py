"""The engine produces exactly what the model computes, for many requests at once."""

from __future__ import annotations

import pytest
import torch
from engine_harness import random_prompts, run_all

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.kv.batch import PackedBatch
from dsinfer.models.loader import load_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint, progress=False)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return Tokenizer.from_dir(tiny_checkpoint)


def _engine(model, tokenizer, **options) -> LLMEngine:
    defaults = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 160}
    return LLMEngine(model, tokenizer, EngineConfig(**{**defaults, **options}))


def _greedy_by_recompute(model, prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        logits = model(PackedBatch.from_sequences([tokens]), logits_for=torch.tensor([len(tokens) - 1]))
        tokens.append(int(logits[0].argmax()))
    return tokens[len(prompt) :]


def test_batch_with_chunked_prefill_and_preemption_equals_full_recompute(model, tokenizer):
    prompts = random_prompts(16, seed=1)
    engine = _engine(model, tokenizer, num_cache_blocks=14, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = run_all(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0  # the small cache forced recomputation
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == _greedy_by_recompute(model, prompt, 10)
    assert engine.blocks.num_used == 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True),
])  # fmt: skip
def test_output_is_the_same_alone_and_in_a_busy_batch(model, tokenizer, params):
    probe = random_prompts(1, seed=9)[0]
    alone = run_all(_engine(model, tokenizer), [probe], params)[0].outputs[0].token_ids
    others = random_prompts(7, seed=10)
    busy_params = [SamplingParams(temperature=1.0, seed=s, max_tokens=15, ignore_eos=True) for s in range(7)]
    busy = run_all(
        _engine(model, tokenizer), others[:3] + [probe] + others[3:], busy_params[:3] + [params] + busy_params[3:]
    )
    assert busy[3].outputs[0].token_ids == alone


def test_prefix_cache_hit_gives_the_same_tokens_as_a_miss(model, tokenizer):
    shared = random_prompts(1, seed=3, low=140, high=141)[0]
    prompts = [shared + [7, 8, 9], shared + [10], shared + [7, 8, 9]]
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    ]
    cold = _engine(model, tokenizer, enable_prefix_caching=False, max_model_len=200)
    expected = [o.outputs[0].token_ids for o in run_all(cold, prompts, params)]
    warm = _engine(model, tokenizer, max_model_len=200)
    got = []
    for prompt, sp in zip(prompts, params, strict=True):  # one after another, so later ones can hit
        got.append(run_all(warm, [prompt], sp)[0].outputs[0].token_ids)
    assert warm.blocks.prefix_hits >= 2 * (len(shared) // warm.blocks.block_tokens)
    assert got == expected
    assert warm.blocks.num_used == 0


def test_two_hundred_requests_return_every_block(model, tokenizer):
    engine = _engine(model, tokenizer, num_cache_blocks=30, max_num_seqs=16, max_num_batched_tokens=128)
    prompts = random_prompts(200, seed=4, low=2, high=60)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=1 + i % 5) for i in range(200)]
    outputs = run_all(engine, prompts, params)
    assert len(outputs) == 200 and all(o.finished for o in outputs)
    assert engine.blocks.num_used == 0
    assert sorted(engine.scheduler.free_slots) == list(range(16))
    assert not engine.requests


def test_stop_conditions(model, tokenizer):
    engine = _engine(model, tokenizer)
    prompt = random_prompts(1, seed=6)[0]
    free_run = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 12
    # A stop token id ends the completion at that token.
    stop_id = free_run.token_ids[5]
    first = free_run.token_ids.index(stop_id)
    stopped = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))[0]
    assert stopped.outputs[0].token_ids == free_run.token_ids[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    # min_tokens keeps the stop token from being chosen before the minimum is reached.
    delayed = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2,
                                                      stop_token_ids=[stop_id]))[0].outputs[0]  # fmt: skip
    assert len(delayed.token_ids) >= first + 2 and stop_id not in delayed.token_ids[: first + 2]
    # A stop string cuts the text where it starts.
    text = free_run.text
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    if needle.strip():
        cut = run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=12, stop=[needle], ignore_eos=True))[0]
        assert cut.outputs[0].finish_reason == "stop" and needle not in cut.outputs[0].text
        assert text.startswith(cut.outputs[0].text)


def test_logprobs_and_n(model, tokenizer):
    engine = _engine(model, tokenizer)
    prompt = random_prompts(1, seed=8)[0]
    out = run_all(engine, [prompt], SamplingParams(temperature=0.8, n=3, seed=11, max_tokens=5, logprobs=3))[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) > 1
    for completion in out.outputs:
        assert len(completion.logprobs) == 5 and len(completion.top_logprobs) == 5
        assert all(len(top) == 3 for top in completion.top_logprobs)
        assert all(lp <= 0 for lp in completion.logprobs)


def test_bad_requests_are_rejected_and_the_engine_keeps_serving(model, tokenizer):
    engine = _engine(model, tokenizer, max_model_len=40)
    with pytest.raises(ValueError, match=r"prompt has 40 tokens, at or above max_model_len \(40\)"):
        engine.add_request(list(range(3, 43)))
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 512\)"):
        engine.add_request([5, 600])
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([])
    out = run_all(engine, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 40 - 3


def test_abort_frees_the_cache(model, tokenizer):
    engine = _engine(model, tokenizer)
    rid = engine.add_request(random_prompts(1, seed=12)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.blocks.num_used > 0
    engine.abort(rid)
    assert engine.blocks.num_used == 0 and not engine.has_unfinished_requests()
