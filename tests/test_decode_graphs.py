"""Decode in static-shape buckets (the CUDA-graph path, run eagerly on the CPU) gives plain decoding's tokens."""

from __future__ import annotations

import pytest
import torch
from engine_harness import random_prompts, run_all

from dsinfer.config import ConfigError, EngineConfig
from dsinfer.engine.decode_graphs import default_graph_sizes
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer


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
    graphs.run = lambda *args: calls.append(len(args[1])) or original(*args)
    bucketed = run_all(bucketed_engine, prompts, params)
    assert [o.outputs[0].token_ids for o in bucketed] == [o.outputs[0].token_ids for o in plain]
    assert 3 in calls or 1 in calls, calls  # steps that needed padding ran through the buckets
    assert bucketed_engine.blocks.num_used == 0


def test_v41_bucketed_decode_equals_plain_decode(tiny_v41_checkpoint):
    """V4.1 decode through the buckets: Engram rows and history, CSA2 sources and the trash block's unfinished
    entries; with a prefix hit, whose first step rebuilds the Engram history and must not run in a bucket.
    Fake quantization off: a batch of 4 padded rows rounds in another order than a batch of 3 (see
    tests/test_engine_v41.py)."""
    model = load_model(tiny_v41_checkpoint, progress=False).set_fake_quantization(False)
    tokenizer = Tokenizer.from_dir(tiny_v41_checkpoint)
    shared = random_prompts(1, seed=3, low=60, high=61)[0]
    prompts = random_prompts(4, seed=9, low=5, high=40) + [shared, shared + [11]]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 4 + [
        SamplingParams(max_tokens=10, temperature=0.8, seed=s, ignore_eos=True) for s in range(2)
    ]
    options = {"num_cache_blocks": 64, "block_tokens": 8, "max_model_len": 160}
    plain_engine = _engine(model, tokenizer, **options)
    plain = run_all(plain_engine, prompts, params)
    bucketed_engine = _engine(model, tokenizer, cuda_graph_sizes=(1, 2, 4), **options)
    graphs = bucketed_engine.runner.decode_graphs
    assert graphs is not None
    calls = []
    original = graphs.run
    graphs.run = lambda *args: calls.append(len(args[1])) or original(*args)
    bucketed = run_all(bucketed_engine, prompts[:4], params[:4])
    for prompt, sp in zip(prompts[4:], params[4:], strict=True):  # one after the other: the second one hits
        bucketed += run_all(bucketed_engine, [prompt], sp)
    assert bucketed_engine.blocks.prefix_hits > 0
    assert [o.outputs[0].token_ids for o in bucketed] == [o.outputs[0].token_ids for o in plain]
    assert 3 in calls and 1 in calls, calls
    assert bucketed_engine.blocks.num_used == 0
    plain_engine.close()
    bucketed_engine.close()


def test_enforce_eager_and_default_sizes(model, tokenizer):
    assert _engine(model, tokenizer, cuda_graph_sizes=(2,), enforce_eager=True).runner.decode_graphs is None
    assert _engine(model, tokenizer).runner.decode_graphs is None  # CPU: off unless sizes are given
    assert default_graph_sizes(16) == (1, 2, 4, 8, 16)
    assert default_graph_sizes(6) == (1, 2, 4, 6)
    with pytest.raises(ConfigError, match="cuda_graph_sizes"):
        EngineConfig(cuda_graph_sizes=(0, 2))


def test_host_into_device_fills_a_kept_buffer_and_refuses_a_mismatch():
    """A graph's input buffer is written in place (the captured graph reads that memory); a wrong count or a
    strided target is an error, not a partial write."""
    from dsinfer.kv.batch import host_into_device

    buffer = torch.zeros(2, 3, dtype=torch.long)
    address = buffer.data_ptr()
    host_into_device(buffer, [1, 2, 3, 4, 5, 6])
    assert buffer.tolist() == [[1, 2, 3], [4, 5, 6]] and buffer.data_ptr() == address
    with pytest.raises(ValueError, match="5 values for a target of 6"):
        host_into_device(buffer, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="not contiguous"):
        host_into_device(buffer[:, :2], [1, 2, 3, 4])
