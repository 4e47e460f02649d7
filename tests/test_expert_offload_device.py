"""Offloaded experts fetched on the device through fixed-size lists: the static-shape decode path (what CUDA graphs
replay, run eagerly on the CPU), fetch-ahead, a host store that keeps only the offloaded experts, and EP ranks,
each giving the all-resident greedy tokens."""

from __future__ import annotations

import pytest
import torch
from engine_harness import random_prompts, run_all

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.llm import LLM
from dsinfer.models.loader import load_model
from dsinfer.offload import install_expert_offload
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _run(checkpoint, resident: int | None, graphs: bool, **offload_options):
    """Greedy tokens of 12 prompts (chunked prefill, preemption), decode on the static-shape buffers when
    ``graphs``; the tokens, the engine, the offload and how many decode steps the static path ran."""
    model = load_model(checkpoint, progress=False)
    offload = None if resident is None else install_expert_offload(model, resident, **offload_options)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=48, max_model_len=160, num_cache_blocks=14,
                          cuda_graph_sizes=(1, 2, 4, 8) if graphs else None)  # fmt: skip
    engine = LLMEngine(model, Tokenizer.from_dir(checkpoint), config)
    static_steps = []
    if graphs:
        run_static = engine.runner.decode_graphs.run
        engine.runner.decode_graphs.run = lambda *a, **k: static_steps.append(1) or run_static(*a, **k)
    outputs = run_all(engine, random_prompts(12, seed=3), GREEDY)
    return [out.outputs[0].token_ids for out in outputs], engine, offload, len(static_steps)


@pytest.mark.parametrize(
    "options",
    [
        {"fetch_ahead": True, "rebalance_every": 3},
        {"fetch_ahead": False, "rebalance_every": 3},
        {"fetch_ahead": True, "rebalance_every": 2, "host_keeps_every_expert": False},
    ],
    ids=["fetch-ahead", "own-layer-fetch", "host-keeps-offloaded-only"],
)
def test_static_shape_decode_with_offload_gives_the_all_resident_tokens(tiny_checkpoint, options):
    expected, _, _, _ = _run(tiny_checkpoint, None, graphs=False)
    tokens, engine, offload, static_steps = _run(tiny_checkpoint, 3, graphs=True, **options)
    assert static_steps > 5 and engine.scheduler.num_preemptions > 0
    assert tokens == expected
    counts = offload.arena.counts()
    assert counts["fetched"] > 0 and 0 < counts["gpu_reads"] < counts["reads"]
    assert (counts["fetched_ahead"] > 0) == options["fetch_ahead"]
    assert offload.steps >= 6  # the runner called before_step; re-balances ran between steps


def test_v41_static_shape_decode_with_offload(tiny_v41_checkpoint):
    expected, _, _, _ = _run(tiny_v41_checkpoint, None, graphs=False)
    tokens, _, offload, static_steps = _run(tiny_v41_checkpoint, 2, graphs=True, rebalance_every=2,
                                            host_keeps_every_expert=False)  # fmt: skip
    assert static_steps > 0 and tokens == expected
    assert offload.arena.fetched_experts > 0


def test_a_swap_rebalance_keeps_each_expert_in_exactly_one_place(tiny_checkpoint):
    """With a host store of only the offloaded experts, experts leaving the GPU are written to the host rows of
    those entering: afterwards every expert's bytes are where the tables say, equal to the checkpoint's."""
    model = load_model(tiny_checkpoint, progress=False)
    original = [moe.ffn.routed_weights().w13.clone() for moe in model.layers]
    offload = install_expert_offload(model, 3, host_keeps_every_expert=False, rebalance_every=10**9)
    layer = offload.layers[1]
    offload.stats.counts[1] = torch.tensor([0, 9, 0, 8, 0, 7, 0, 0])  # experts 1, 3, 5 become the most routed
    offload.stats.observed = True
    offload.stats.snapshot()
    assert layer.resident == [0, 2, 5] and layer.rebalance() == 2 and layer.resident == [1, 3, 5]
    host, arena = layer.host, offload.arena.weights
    for expert in range(8):
        if expert in layer.resident:
            assert host.row_list[expert] == -1
            stored = arena.w13[layer.slot_list[expert]]
        else:
            stored = host.weights.w13[host.row_list[expert]]
        assert torch.equal(stored, original[1][expert]), expert
    assert torch.equal(host.row_of_expert, torch.tensor(host.row_list))


def test_a_correct_prediction_leaves_the_layer_nothing_to_fetch(tiny_checkpoint):
    """Fetch-ahead copies what the next layer's router picks; when it picks the same experts at its turn, the
    layer's own fetch copies none (the counters: every copy was made ahead)."""
    model = load_model(tiny_checkpoint, progress=False)
    offload = install_expert_offload(model, 2, fetch_ahead=True)
    layer = offload.layers[2]
    x = torch.randn(5, model.config.hidden_size)
    ids, _ = layer.router(x, None)
    layer.prefetch(x, None)
    ahead = offload.arena.counts()
    layer.stage(x[:0], ids)
    after = offload.arena.counts()
    assert ahead["fetched_ahead"] > 0 and after["fetched"] == ahead["fetched"]
    other = offload.layers[3]
    wrong = (other.router(x, None)[0] + 1) % 8  # a prediction that misses: the layer fetches the rest itself
    other.prefetch(x, None)
    before = offload.arena.counts()["fetched"]
    other.stage(x[:0], wrong)
    assert offload.arena.counts()["fetched"] > before


def test_two_ep_ranks_with_offloaded_experts_give_one_ranks_tokens(tiny_checkpoint):
    small = {"num_cache_blocks": 6, "max_num_batched_tokens": 48, "max_model_len": 128}
    prompts = random_prompts(6, seed=1, high=90)
    with LLM(tiny_checkpoint, **small) as one:
        expected = [out.outputs[0].token_ids for out in one.generate(prompts, GREEDY, use_tqdm=False)]
    model = load_model(tiny_checkpoint, progress=False)
    expert_bytes = model.layers[0].ffn.routed_weights().nbytes // 8
    budget = (4 * 1 + 2 * 3) * expert_bytes / 2**30  # per rank: 1 of its 4 experts resident in 4 layers + fetch
    options = {"data_parallel_size": 2, "expert_parallel_size": 2, "expert_offload": budget}
    with LLM(tiny_checkpoint, **options, **small) as llm:
        got = [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == expected
    with pytest.raises(Exception, match="cannot hold even the fetch buffers"):
        LLM(tiny_checkpoint, **{**options, "expert_offload": expert_bytes / 2**30}, **small)
