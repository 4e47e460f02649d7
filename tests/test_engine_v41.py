"""The engine serves DeepSeek-V4.1: it produces exactly what the V4.1 model computes, for many requests at once.

Runs on the tiny V4.1 checkpoint (every CSA2 layer role, Engram on two layers). The comparisons of two
evaluation orders turn the trained-in fake quantization off: with it on, a value within float32 noise of a
rounding midpoint can land on another FP8 code in one order than in the other (tests/test_v41_model.py
covers those decisions); everything the engine adds (slots, block tables, chunking, preemption, prefix
replay, Engram history) is the same either way. The CLI and server tests run the checkpoint as loaded.
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from engine_harness import random_prompts, run_all
from server_harness import running_server

from dsinfer.chat.format import encode_chat
from dsinfer.cli import main
from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.engine.model_runner import ModelRunner
from dsinfer.engram.hashing import EngramContext
from dsinfer.kv.batch import PackedBatch
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.models.loader import load_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model(tiny_v41_checkpoint):
    return load_model(tiny_v41_checkpoint, progress=False).set_fake_quantization(False)


@pytest.fixture(scope="module")
def tokenizer(tiny_v41_checkpoint):
    return Tokenizer.from_dir(tiny_v41_checkpoint)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def make_engine(model, tokenizer):
    """Engines built with small V4.1 defaults; closed (device worker stopped) after the test."""
    engines = []

    def build(**options) -> LLMEngine:
        defaults = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 160, "num_cache_blocks": 64,
                    "block_tokens": 16}  # fmt: skip
        engines.append(LLMEngine(model, tokenizer, EngineConfig(**{**defaults, **options})))
        return engines[-1]

    yield build
    for engine in engines:
        engine.close()


def _greedy_by_recompute(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations, each token from a full forward of every whole sequence (fresh scratch cache)."""
    sequences = [list(prompt) for prompt in prompts]
    for _ in range(max_tokens):
        batch = PackedBatch.from_sequences(sequences)
        for seq, token in zip(
            sequences, model(batch, logits_for=batch.last_token_indices()).argmax(-1).tolist(), strict=True
        ):
            seq.append(token)
    return [seq[len(prompt) :] for seq, prompt in zip(sequences, prompts, strict=True)]


# ---- the cache the runner builds --------------------------------------------------------------------------
def test_runner_builds_a_v41_cache_sized_by_its_own_accounting(model):
    engine = EngineConfig(max_num_seqs=4, cache_memory_bytes=3 * 2**20, block_tokens=8)
    runner = ModelRunner(model, engine, max_model_len=160)
    assert isinstance(runner.cache, KVCacheV41) and not runner.cache.dspark_rings  # no DSpark state in the engine
    assert runner.block_tokens == runner.cache.block_tokens == 8
    probe = KVCacheV41(model.config, 1, 1, 8, torch.float32, "cpu")
    assert probe.spare_blocks == 1  # the trash block beside the pool (decode writes unfinished entries there)
    assert runner.num_blocks == (3 * 2**20 - 4 * probe.slot_bytes()) // probe.block_bytes() - probe.spare_blocks
    assert runner.cache.num_slots == 4
    default = ModelRunner(model, EngineConfig(max_num_seqs=2, num_cache_blocks=10), max_model_len=160)
    assert default.num_blocks == 10 and default.block_tokens == 128  # V4.1's default block size
    with pytest.raises(ValueError, match="block_tokens: must be a positive multiple of 2"):
        ModelRunner(model, EngineConfig(block_tokens=7, num_cache_blocks=40), max_model_len=160)
    with pytest.raises(ValueError, match="cache budget too small: 1 blocks of 128 tokens"):
        ModelRunner(model, EngineConfig(num_cache_blocks=1), max_model_len=160)
    with pytest.raises(ValueError, match="the engine serves DeepseekV4 and DeepseekV41 models.*got Linear"):
        ModelRunner(torch.nn.Linear(2, 2), EngineConfig(num_cache_blocks=4), max_model_len=16)


# ---- the engine against the model -------------------------------------------------------------------------
def test_batch_with_chunked_prefill_and_preemption_equals_full_recompute(model, make_engine):
    prompts = random_prompts(16, seed=1, high=80)
    engine = make_engine(num_cache_blocks=14, max_num_batched_tokens=48)
    chunked = []
    execute = engine.runner.execute

    def watched_execute(step):
        chunked.extend(span.length for span in step.spans if span.length > 1 and span.start > 0)
        return execute(step)

    engine.runner.execute = watched_execute
    outputs = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0  # the small cache forced recomputation
    assert chunked  # some prompt was continued in a later step (chunked prefill)
    assert [out.outputs[0].token_ids for out in outputs] == _greedy_by_recompute(model, prompts, 6)
    assert engine.blocks.num_used == 0


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True),
])  # fmt: skip
def test_output_is_the_same_alone_and_in_a_busy_batch(make_engine, params):
    probe = random_prompts(1, seed=9, high=80)[0]
    alone = run_all(make_engine(), [probe], params)[0].outputs[0].token_ids
    others = random_prompts(7, seed=10, high=80)
    busy_params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in range(7)]
    busy = run_all(make_engine(), others[:3] + [probe] + others[3:], busy_params[:3] + [params] + busy_params[3:])
    assert busy[3].outputs[0].token_ids == alone


def test_prefix_cache_hit_gives_the_same_tokens_as_a_miss(model, make_engine, monkeypatch):
    """A hit replays from position 56 (not 0) over shared blocks; the Engram history there is the prompt's."""
    shared = random_prompts(1, seed=3, low=200, high=201)[0]
    prompts = [shared + [7, 8, 9], shared + [10], shared + [7, 8, 9]]
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    ]
    options = {"block_tokens": 8, "max_model_len": 240, "num_cache_blocks": 100}
    cold = make_engine(enable_prefix_caching=False, **options)
    expected = [o.outputs[0].token_ids for o in run_all(cold, prompts, params)]

    warm = make_engine(**options)
    replay = model.config.num_hidden_layers * model.config.sliding_window  # 144 positions
    replay_start = (200 - replay) // 8 * 8
    assert replay_start == 56
    entered = []  # (start, reuse_below, Engram history the model continues from) of steps entering past 0
    original = model._engram_rows

    def engram_rows(batch):
        for span in batch.spans:
            if span.start == span.window_from > 0:
                entered.append((span.start, span.reuse_below, batch.cache.engram_history[span.slot].tolist()))
        return original(batch)

    monkeypatch.setattr(model, "_engram_rows", engram_rows)
    got = []
    for prompt, sp in zip(prompts, params, strict=True):  # one after another, so later ones can hit
        got.append(run_all(warm, [prompt], sp)[0].outputs[0].token_ids)
    assert warm.blocks.prefix_hits >= 2 * (200 // 8)
    context = model.engram_hasher.advance(EngramContext.empty(model.config.engram_max_ngram_size), shared[:56])
    assert entered == [(56, 200, list(context.history))] * 2  # both hits started mid-prompt, from the right context
    assert got == expected
    assert warm.blocks.num_used == 0


def test_two_hundred_requests_return_every_block(make_engine):
    engine = make_engine(num_cache_blocks=30, max_num_seqs=16, max_num_batched_tokens=128)
    prompts = random_prompts(200, seed=4, low=2, high=40)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=1 + i % 3) for i in range(200)]
    outputs = run_all(engine, prompts, params)
    assert len(outputs) == 200 and all(o.finished for o in outputs)
    assert engine.blocks.num_used == 0
    assert sorted(engine.scheduler.free_slots) == list(range(16))
    assert not engine.requests


def test_prompt_ids_outside_the_engram_vocabulary_are_rejected_before_any_step(model, make_engine, monkeypatch):
    """The forward does not range-check token ids (that would read them on the host): the engine does, on the
    prompt as a host list, against the smaller of the model's and the Engram hasher's vocabularies."""
    engine = make_engine()
    monkeypatch.setattr(type(model.engram_hasher), "vocab_size", property(lambda self: 100))
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 100\)"):
        engine.add_request([5, 100])
    assert not engine.requests


# ---- the user-facing entries ------------------------------------------------------------------------------
def test_generate_cli_runs_a_v41_checkpoint(tiny_v41_checkpoint, tokenizer, capsys):
    args = ["generate", str(tiny_v41_checkpoint), "--prompt", "Hello world", "--max-tokens", "6", "--device", "cpu"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    loaded = load_model(tiny_v41_checkpoint, progress=False)  # as the CLI runs it: fake quantization on
    tokens = [tokenizer.bos_id, *tokenizer.encode("Hello world", allow_special=False)]
    new = []
    for _ in range(6):
        new.append(int(loaded(PackedBatch.from_sequences([tokens + new]))[-1].argmax()))
        if new[-1] == tokenizer.eos_id:
            break
    expected = tokenizer.decode(new, skip_special_tokens=True)
    assert f"'Hello world' -> {expected!r}" in printed  # the engine's greedy tokens equal plain recomputation


def test_server_answers_a_chat_completion_on_a_v41_checkpoint(tiny_v41_checkpoint, tokenizer):
    """The real server, the official client; prompts use V4.1's chat spelling (system text after <｜System｜>)."""
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512, num_cache_blocks=64)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    v41_prompt = encode_chat(tokenizer, messages, variant="v41", thinking=False)
    assert v41_prompt != encode_chat(tokenizer, messages, variant="v4", thinking=False)
    with running_server(tiny_v41_checkpoint, config) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        tokenized = httpx.post(f"{base}/tokenize", json={"messages": messages}, timeout=10).json()
    assert tokenized["tokens"] == v41_prompt
    assert reply.usage.prompt_tokens == len(v41_prompt)
    assert reply.choices[0].finish_reason in ("length", "stop") and 1 <= reply.usage.completion_tokens <= 8
    assert again.choices[0].message.content == reply.choices[0].message.content  # greedy: the same answer
