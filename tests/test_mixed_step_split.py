"""A mixed step (decodes beside prefill chunks) runs its decodes as a forward of their own: same tokens as one.

The V4.1 model runs with its trained-in fake quantization off, as the engine's other two-order comparisons do
(tests/test_engine_v41.py says why).
"""

from __future__ import annotations

import pytest
import torch
from engine_harness import random_prompts, run_all

from dsinfer.config import EngineConfig
from dsinfer.engine import model_runner
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["v4", "v41"])
def checkpoint(request, tiny_checkpoint, tiny_v41_checkpoint):
    return tiny_checkpoint if request.param == "v4" else tiny_v41_checkpoint


@pytest.fixture(scope="module")
def model(checkpoint):
    model = load_model(checkpoint, progress=False)
    return model.set_fake_quantization(False) if hasattr(model, "set_fake_quantization") else model


def _generate(model, checkpoint, split: bool, graph_sizes) -> tuple[list[list[int]], int]:
    """Greedy tokens of prompts that arrive while others decode; and how many steps ran split."""
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=40, max_model_len=192, cuda_graph_sizes=graph_sizes)
    engine = LLMEngine(model, Tokenizer.from_dir(checkpoint), config)
    runner = engine.runner
    runner.split_mixed_steps = split
    splits = []
    execute_split = runner._execute_split
    runner._execute_split = lambda step, decodes: splits.append(decodes) or execute_split(step, decodes)
    prompts = random_prompts(12, seed=3, low=20, high=90)
    outputs = run_all(engine, prompts, SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    assert engine.blocks.num_used == 0
    return [out.outputs[0].token_ids for out in outputs], len(splits)


@pytest.mark.parametrize("graph_sizes", [None, [4, 8]], ids=["eager", "decode-buckets"])
def test_split_mixed_steps_give_the_tokens_of_one_forward(model, checkpoint, graph_sizes):
    joined, none = _generate(model, checkpoint, split=False, graph_sizes=graph_sizes)
    split, count = _generate(model, checkpoint, split=True, graph_sizes=graph_sizes)
    assert none == 0
    assert count > 0  # the prompts' chunks met at least MIXED_STEP_DECODE_SPLIT_ROWS decoding sequences
    assert split == joined


def test_leading_decodes_counts_only_a_mixed_step():
    def step(*lengths):
        spans = [type("Span", (), {"length": n})() for n in lengths]
        return type("Step", (), {"spans": spans, "sample_rows": torch.zeros(len(lengths))})()

    assert model_runner.ModelRunner.leading_decodes(step(1, 1, 1, 7)) == 3
    assert model_runner.ModelRunner.leading_decodes(step(1, 1, 1)) == 0  # a pure decode step
    assert model_runner.ModelRunner.leading_decodes(step(5, 1, 1)) == 0  # a chunk first
