"""Speculative decoding on two data-parallel ranks (gloo, one process each): every rank drafts and verifies its
own requests, greedy tokens equal one rank's plain decoding for K = 1, 3, 5 on V4 (MTP) and V4.1 (DSpark) with
chunked prefill and preemption, the ranks' drafting totals add up, and many requests give every block back.

Two ranks means two EP ranks too (the layout's DP x CP = EP): the verify forward's MoE dispatch crosses ranks,
so a rank that speculates while its peer idles must still meet it in every collective.
"""

from __future__ import annotations

import pytest
from engine_harness import random_prompts

from dsinfer.llm import LLM
from dsinfer.models.tiny import default_model_dir, make_tiny_checkpoint
from dsinfer.sampling_params import SamplingParams
from dsinfer.speculative.executor import SpeculativeStats

# Per rank: a cache too small for its four sequences (preemptions) and a step budget below the prompt lengths.
SMALL = {
    "v4": {"num_cache_blocks": 4, "max_num_batched_tokens": 40, "max_model_len": 96},  # blocks of 32
    "v41": {"num_cache_blocks": 8, "max_num_batched_tokens": 40, "max_model_len": 96, "block_tokens": 16},
}
PROMPTS = random_prompts(8, seed=1, low=40, high=63)
GREEDY = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
METHODS = {"v4": "mtp", "v41": "dspark"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_checkpoint):
    """V4 as the suites share it; V4.1 with the release's DSpark block of 5 (so K = 5 drafts five tokens)."""
    v41 = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-v41-block5"), seed=0, arch="v41", dspark_block_size=5)
    return {"v4": tiny_checkpoint, "v41": v41}


@pytest.fixture(scope="module")
def plain_tokens(checkpoints):
    """One rank's plain greedy decoding of the prompts, per model."""
    tokens = {}
    for name, checkpoint in checkpoints.items():
        with LLM(checkpoint, **SMALL[name]) as one:
            tokens[name] = [out.outputs[0].token_ids for out in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    return tokens


def _two_ranks(checkpoint, model: str, k: int) -> LLM:
    spec = {"method": METHODS[model], "num_speculative_tokens": k}
    return LLM(checkpoint, data_parallel_size=2, expert_parallel_size=2, speculative_config=spec, **SMALL[model])


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("model", ["v4", "v41"])
def test_greedy_on_two_speculating_ranks_matches_one_ranks_plain_decoding(checkpoints, plain_tokens, model, k):
    with _two_ranks(checkpoints[model], model, k) as llm:
        got = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        load, ranks = llm.engine.load(), llm.engine.rank_loads
        assert load.preemptions > 0 and load.blocks_used == 0
        per_rank = [ranks[r].spec_stats for r in sorted(ranks)]
        assert all(stats is not None and stats.num_drafts > 0 for stats in per_rank)  # both ranks speculated
        assert load.spec_stats == SpeculativeStats.total(per_rank)
        assert load.spec_stats.num_draft_tokens == sum(stats.num_draft_tokens for stats in per_rank)
    assert got == plain_tokens[model]


def test_accepted_drafts_reach_the_api_process_as_several_tokens_a_step():
    # The tiny random models' drafts are almost never right; the embedded default's trained DSpark stages are,
    # so whole accepted runs cross the pipe and are appended token by token.
    prompts, greedy = random_prompts(4, seed=2, low=10, high=30), SamplingParams(temperature=0, max_tokens=16)
    with LLM(default_model_dir(), max_model_len=128) as one:
        expected = [out.outputs[0].token_ids for out in one.generate(prompts, greedy, use_tqdm=False)]
    spec = {"method": "dspark", "num_speculative_tokens": 3}
    with LLM(default_model_dir(), max_model_len=128, data_parallel_size=2, expert_parallel_size=2,
             speculative_config=spec) as llm:  # fmt: skip
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy, use_tqdm=False)]
        assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert got == expected


def test_many_requests_on_two_speculating_ranks_return_every_block(tiny_checkpoint):
    prompts = random_prompts(200, seed=4, low=2, high=12)
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=1 + i % 5) for i in range(200)]
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    with LLM(tiny_checkpoint, data_parallel_size=2, expert_parallel_size=2, speculative_config=spec) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        ranks = llm.engine.rank_loads
        assert all(load.blocks_used == 0 and load.running == 0 for load in ranks.values())
        assert all(load.spec_stats.num_drafts > 0 for load in ranks.values())
    assert [len(out.outputs[0].token_ids) for out in outputs] == [1 + i % 5 for i in range(200)]
