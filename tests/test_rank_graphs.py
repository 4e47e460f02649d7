"""Decode buckets on EP ranks (the CUDA-graph path, run eagerly on the CPU with the fixed-capacity dispatch):
two DP ranks give one rank's greedy tokens, through steps where the ranks decode different batch sizes in one
bucket and steps where one rank is idle and runs the bucket with every row padding."""

from __future__ import annotations

from engine_harness import random_prompts

from dsinfer.llm import LLM
from dsinfer.sampling_params import SamplingParams

OPTIONS = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 128}


def test_ranks_replaying_decode_buckets_give_one_ranks_greedy_tokens(tiny_checkpoint):
    # The balancer sends the long prompt to rank 0 and both short ones to rank 1. Rank 0 prefills in two chunks
    # while rank 1 already decodes (a step rank 1 could replay but everyone runs eagerly), then rank 1 decodes two
    # sequences while rank 0 decodes one (both in bucket 2), then rank 1's end and it idles in bucket 1.
    prompts = [random_prompts(1, seed=9, low=100, high=101)[0], *random_prompts(2, seed=4, low=8, high=20)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 3, 4)]
    with LLM(tiny_checkpoint, **OPTIONS) as one:
        expected = [out.outputs[0].token_ids for out in one.generate(prompts, params, use_tqdm=False)]
    with LLM(tiny_checkpoint, data_parallel_size=2, expert_parallel_size=2, cuda_graph_sizes=(1, 2, 4),
             **OPTIONS) as llm:  # fmt: skip
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        loads = llm.engine.rank_loads
    assert got == expected
    assert loads[0].graph_steps >= 8 and loads[0].padded_graph_steps == 0, loads  # nine decode steps after prefill
    assert loads[1].graph_steps >= 1 and loads[1].padded_graph_steps >= 5, loads


def test_enforce_eager_keeps_rank_engines_eager(tiny_checkpoint):
    prompts = random_prompts(2, seed=2, low=5, high=20)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(tiny_checkpoint, **OPTIONS) as one:
        expected = [out.outputs[0].token_ids for out in one.generate(prompts, params, use_tqdm=False)]
    with LLM(tiny_checkpoint, data_parallel_size=2, expert_parallel_size=2, cuda_graph_sizes=(1, 2),
             enforce_eager=True, **OPTIONS) as llm:  # fmt: skip
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        loads = llm.engine.rank_loads
    assert got == expected
    assert all(load.graph_steps == 0 and load.padded_graph_steps == 0 for load in loads.values()), loads
