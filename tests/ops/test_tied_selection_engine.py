"""Tied indexer scores give the same greedy tokens whatever the prefill token budget (chunking)."""

from __future__ import annotations

import pytest
from engine_harness import random_prompts, run_all

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tied_model(tiny_checkpoint):
    """The tiny V4 model with one indexer head left: about half its ReLU scores are exactly 0, and tie.

    With one head, score = w(x) * ReLU(q . k): every entry with q . k <= 0 scores 0, and whenever fewer than
    ``index_topk`` entries score above 0 (or w(x) < 0) the choice among the zeros is the tie-break's alone.
    """
    model = load_model(tiny_checkpoint, progress=False)
    tied = 0
    for layer in model.layers:
        if layer.attn.indexer is not None:
            layer.attn.indexer.weights_proj.weight[1:].zero_()
            tied += 1
    assert tied, "the tiny model has no CSA layer"
    return model


def _greedy(model, tokenizer, prompts, budget: int) -> list[list[int]]:
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=200)
    engine = LLMEngine(model, tokenizer, config)
    outputs = run_all(engine, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    return [out.outputs[0].token_ids for out in outputs]


def test_tied_indexer_scores_do_not_depend_on_the_prefill_budget(tied_model, tiny_checkpoint):
    tokenizer = Tokenizer.from_dir(tiny_checkpoint)
    # Long enough that the indexer sees more entries than its top-k (index_topk=4 entries of 4 tokens).
    prompts = random_prompts(4, seed=11, low=60, high=120)
    by_budget = {budget: _greedy(tied_model, tokenizer, prompts, budget) for budget in (16, 40, 512)}
    assert by_budget[16] == by_budget[40] == by_budget[512]
    assert all(len(tokens) == 12 for tokens in by_budget[512])
