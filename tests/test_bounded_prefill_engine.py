"""V4.1's bounded (CED) prefill in the engine: the decoder layers run over only each prompt's last replay tokens.

The engine's result must not depend on how a prompt was cut into chunks, on preemption or on a prefix-cache hit:
it equals one bounded prefill of the whole prompt followed by plain decode steps. The reference for that one-shot
prefill is the CED pass as first written (the encoder over the prompt, the first decoder layer's compressor over
every position, then the decoder over the last tokens with those entries reused), not the engine's split.
Fake quantization off: two evaluation orders may round a value near an FP8 midpoint apart (tests/test_v41_model.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from engine_harness import random_prompts, run_all

from dsinfer.config import ConfigError, EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import build_random_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

REPLAY = 24  # the tiny model's window is 16: prompts of 10-80 tokens then cross the replay boundary


@pytest.fixture(scope="module")
def model(tiny_v41_checkpoint):
    return load_model(tiny_v41_checkpoint, progress=False).set_fake_quantization(False)


@pytest.fixture(scope="module")
def tokenizer(tiny_v41_checkpoint):
    return Tokenizer.from_dir(tiny_v41_checkpoint)


@pytest.fixture
def make_engine(model, tokenizer):
    engines = []

    def build(**options) -> LLMEngine:
        defaults = {"max_num_seqs": 8, "max_num_batched_tokens": 48, "max_model_len": 160, "num_cache_blocks": 64,
                    "block_tokens": 8, "v41_prefill": "bounded", "v41_replay_tokens": REPLAY}  # fmt: skip
        engines.append(LLMEngine(model, tokenizer, EngineConfig(**{**defaults, **options})))
        return engines[-1]

    yield build
    for engine in engines:
        engine.close()


@torch.inference_mode()
def _ced_as_first_written(model, cache: KVCacheV41, prompt: list[int], table: list[int]) -> torch.Tensor:
    """Logits of the prompt's last token: compressor over the whole prompt, decoder over the last REPLAY tokens."""
    n, keep = len(prompt), min(REPLAY, len(prompt))
    batch = PackedBatch(torch.tensor(prompt), torch.arange(n), [SequenceSpan(0, n, 0, table)], cache)
    decoder = model.config.decoder_start
    ctx = model.context(batch)
    streams, pre_mix = model.embed_streams(batch.input_ids)
    streams, pre_mix = model.run_range(streams, pre_mix, ctx, 0, decoder)
    model.layers[decoder].compress_only(streams, pre_mix, ctx)
    first = n - keep
    rows = torch.arange(first, n)
    span = SequenceSpan(first, keep, 0, table, reuse_below=n, window_from=first)
    replay = PackedBatch(batch.input_ids[rows], batch.positions[rows], [span], cache)
    streams, pre_mix = model.run_range(streams[rows], pre_mix[rows], ctx.sliced(replay, rows), decoder,
                                       len(model.layers))  # fmt: skip
    return model.logits(model.final_hidden(streams, pre_mix), torch.tensor([keep - 1]))[0]


@torch.inference_mode()
def _greedy_after_one_shot_bounded_prefill(model, prompt: list[int], max_tokens: int) -> list[int]:
    cache = KVCacheV41(model.config, 1, math.ceil((len(prompt) + max_tokens) / 8) + 1, 8, torch.float32, "cpu")
    table = list(range(cache.num_blocks))
    tokens = [int(_ced_as_first_written(model, cache, prompt, table).argmax())]
    for position in range(len(prompt), len(prompt) + max_tokens - 1):
        span = SequenceSpan(position, 1, 0, table, window_from=0)
        batch = PackedBatch(torch.tensor(tokens[-1:]), torch.tensor([position]), [span], cache)
        tokens.append(int(model(batch)[0].argmax()))
    return tokens


def test_the_engines_split_equals_the_ced_pass_as_first_written(model):
    """One whole prompt through the engine's split (decoder_from) gives the original pass's logits bit for bit."""
    prompt = random_prompts(1, seed=4, low=70, high=71)[0]
    expected_cache = KVCacheV41(model.config, 1, 10, 8, torch.float32, "cpu")
    expected = _ced_as_first_written(model, expected_cache, prompt, list(range(10)))
    cache = KVCacheV41(model.config, 1, 10, 8, torch.float32, "cpu")
    span = SequenceSpan(0, 70, 0, list(range(10)), decoder_from=70 - REPLAY)
    with torch.inference_mode():
        got = model(PackedBatch(torch.tensor(prompt), torch.arange(70), [span], cache), torch.tensor([69]))[0]
    assert torch.equal(got, expected)
    for layer, (a, b) in enumerate(zip(cache.layers, expected_cache.layers, strict=True)):
        assert torch.equal(a.window, b.window), layer  # the replay (24 tokens) rewrote every row of the 16-row rings
        if a.source is not None:
            assert torch.equal(a.source.entries, b.source.entries), layer
            assert torch.equal(a.source.index_keys, b.source.index_keys), layer


def test_chunked_prefill_and_preemption_equal_one_bounded_prefill(model, make_engine):
    prompts = random_prompts(14, seed=2, low=10, high=80)
    engine = make_engine(num_cache_blocks=14, max_model_len=96)
    skipped = []
    execute = engine.runner.execute

    def watched_execute(step):
        skipped.extend(span.decoder_from > span.start for span in step.spans)
        return execute(step)

    engine.runner.execute = watched_execute
    outputs = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert engine.runner.replay_tokens == REPLAY
    assert engine.scheduler.num_preemptions > 0 and any(skipped)
    expected = [_greedy_after_one_shot_bounded_prefill(model, prompt, 6) for prompt in prompts]
    assert [out.outputs[0].token_ids for out in outputs] == expected
    assert engine.blocks.num_used == 0


def test_a_prefix_hit_gives_the_tokens_of_a_miss(make_engine):
    shared = random_prompts(1, seed=3, low=90, high=91)[0]
    prompts = [shared + [7, 8, 9], shared + [10], shared + [7, 8, 9, 12]]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=5, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]  # fmt: skip
    expected = [o.outputs[0].token_ids for o in run_all(make_engine(enable_prefix_caching=False), prompts, params)]
    warm = make_engine()
    got = [run_all(warm, [prompt], sp)[0].outputs[0].token_ids for prompt, sp in zip(prompts, params, strict=True)]
    assert warm.blocks.prefix_hits > 0
    assert got == expected
    assert warm.blocks.num_used == 0


def test_prompts_no_longer_than_the_replay_prefill_exactly(make_engine):
    prompts = random_prompts(4, seed=6, low=5, high=REPLAY + 1)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    exact_engine = make_engine(v41_prefill="exact")
    assert exact_engine.runner.replay_tokens is None
    exact = [o.outputs[0].token_ids for o in run_all(exact_engine, prompts, params)]
    assert [o.outputs[0].token_ids for o in run_all(make_engine(), prompts, params)] == exact


def test_the_mode_is_resolved_and_checked_before_serving(model, tokenizer, tiny_checkpoint):
    base = {"max_num_seqs": 2, "max_model_len": 160, "num_cache_blocks": 64, "block_tokens": 8}
    default = LLMEngine(model, tokenizer, EngineConfig(**base))
    assert default.runner.replay_tokens == 140  # on by default where the checkpoint has a CED decoder
    default.close()
    spec = {"method": "dspark", "num_speculative_tokens": 2}
    drafting = LLMEngine(model, tokenizer, EngineConfig(**base, speculative_config=spec))
    assert drafting.runner.replay_tokens is None  # speculative decoding prefills exactly
    drafting.close()
    with pytest.raises(ConfigError, match="speculative"):
        LLMEngine(model, tokenizer, EngineConfig(**base, speculative_config=spec, v41_prefill="bounded"))
    with pytest.raises(ConfigError, match="sliding window"):
        LLMEngine(model, tokenizer, EngineConfig(**base, v41_prefill="bounded", v41_replay_tokens=8))
    no_decoder = build_random_model(replace(model.config, compress_ratios=(0, 2, 2, 2, 2, 2, 2, 2, 2)), torch.float32)
    with pytest.raises(ConfigError, match="CED decoder.*layer 5, has ratio 2"):
        LLMEngine(no_decoder, tokenizer, EngineConfig(**base, v41_prefill="bounded"))
    with pytest.raises(ConfigError, match="v41_prefill"):
        EngineConfig(v41_prefill="fast")
    v4 = load_model(tiny_checkpoint, progress=False)
    v4_options = {**base, "block_tokens": None}
    v4_engine = LLMEngine(v4, Tokenizer.from_dir(tiny_checkpoint), EngineConfig(**v4_options, v41_prefill="bounded"))
    assert v4_engine.runner.replay_tokens is None  # V4 has no CED: the option does not apply
    v4_engine.close()
