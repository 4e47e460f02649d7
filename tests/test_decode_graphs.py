"""Decode in static-shape buckets (the CUDA-graph path, run eagerly on the CPU) gives plain decoding's tokens."""

from __future__ import annotations

import pytest
from engine_harness import random_prompts, run_all

from dsinfer.config import ConfigError, EngineConfig
from dsinfer.engine.decode_graphs import default_graph_sizes
from dsinfer.engine.engine import LLMEngine
from dsinfer.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model(tiny_v4_model):
    return tiny_v4_model


@pytest.fixture(scope="module")
def tokenizer(tiny_v4_tokenizer):
    return tiny_v4_tokenizer


def _engine(model, tokenizer, **options) -> LLMEngine:
    defaults = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 200}
    return LLMEngine(model, tokenizer, EngineConfig(**{**defaults, **options}))


def test_bucketed_decode_equals_plain_decode(model, tokenizer):
    """Odd batch sizes pad up to a bucket (3 -> 4); padding rows decode in the spare slot and the trash block."""
    prompts = random_prompts(7, seed=5, low=10, high=90)
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)] * 4 + [
        SamplingParams(max_tokens=9, temperature=0.8, seed=s, ignore_eos=True) for s in range(3)
    ]
    plain = run_all(_engine(model, tokenizer), prompts, params)
    bucketed_engine = _engine(model, tokenizer, cuda_graph_sizes=(1, 2, 4))
    graphs = bucketed_engine.runner.decode_graphs
    assert graphs is not None and graphs.sizes == (1, 2, 4)
    assert bucketed_engine.runner.cache.num_slots == 5  # four sequences and the spare slot
    calls = []
    original = graphs.run
    graphs.run = lambda *args: calls.append(len(args[2])) or original(*args)
    bucketed = run_all(bucketed_engine, prompts, params)
    assert [o.outputs[0].token_ids for o in bucketed] == [o.outputs[0].token_ids for o in plain]
    assert 3 in calls or 1 in calls, calls  # steps that needed padding ran through the buckets
    assert bucketed_engine.blocks.num_used == 0


def test_enforce_eager_and_default_sizes(model, tokenizer):
    assert _engine(model, tokenizer, cuda_graph_sizes=(2,), enforce_eager=True).runner.decode_graphs is None
    assert _engine(model, tokenizer).runner.decode_graphs is None  # CPU: off unless sizes are given
    assert default_graph_sizes(16) == (1, 2, 4, 8, 16)
    assert default_graph_sizes(6) == (1, 2, 4, 6)
    with pytest.raises(ConfigError, match="cuda_graph_sizes"):
        EngineConfig(cuda_graph_sizes=(0, 2))
