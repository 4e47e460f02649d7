"""Routed experts kept in host memory and fetched on use give the same tokens as every expert resident."""

from __future__ import annotations

import json

import pytest
import torch
from engine_harness import random_prompts, run_all

from dsinfer.config import EngineConfig
from dsinfer.config.model import ConfigError
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.offload import ExpertStatsError, install_expert_offload
from dsinfer.offload.install import offload_experts, resident_for_budget
from dsinfer.ops.moe import routed_moe_reference
from dsinfer.ops.quant import quantize_fp4
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_reference_reads_experts_through_the_slot_table_bit_for_bit():
    """The same experts stored in shuffled slots (plus unused ones) give the identical output, top-3 routing."""
    from dsinfer.ops.moe import stack_experts

    generator = torch.Generator().manual_seed(0)
    experts, hidden, inter, tokens = 6, 64, 32, 9

    def fp4(rows, cols):
        return quantize_fp4(torch.randn(rows, cols, generator=generator))

    w1, w3, w2 = ([fp4(inter, hidden) for _ in range(experts)], [fp4(inter, hidden) for _ in range(experts)],
                  [fp4(hidden, inter) for _ in range(experts)])  # fmt: skip
    plain = stack_experts(*[[c for c, _ in w] for w in (w1, w3, w2)], *[[s for _, s in w] for w in (w1, w3, w2)])
    slots = torch.randperm(experts + 3, generator=generator)[:experts]  # expert e lives in slot slots[e]
    scattered = [torch.zeros((experts + 3, *t.shape[1:]), dtype=t.dtype) for t in
                 (plain.w13, plain.w13_scale, plain.w2, plain.w2_scale)]  # fmt: skip
    for tensor, source in zip(scattered, (plain.w13, plain.w13_scale, plain.w2, plain.w2_scale), strict=True):
        tensor[slots] = source
    arena = type(plain)(*scattered, inter, True)
    x = torch.randn(tokens, hidden, generator=generator)
    ids = torch.stack([torch.randperm(experts, generator=generator)[:3] for _ in range(tokens)])
    weights = torch.rand(tokens, 3, generator=generator)
    expected = routed_moe_reference(x, plain, ids, weights, 10.0)
    assert torch.equal(routed_moe_reference(x, arena, ids, weights, 10.0, slot_of_expert=slots), expected)


def _engine(model, tokenizer) -> LLMEngine:
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=48, max_model_len=160, num_cache_blocks=14)
    return LLMEngine(model, tokenizer, config)


def _greedy_tokens(checkpoint, resident: int | None, stats_path=None, every: int = 3):
    """Greedy tokens of 12 prompts under chunked prefill and preemption, with ``resident`` experts per layer on
    the "device" (None: all), re-balancing every ``every`` steps; the engine and the offload."""
    model = load_model(checkpoint, progress=False)
    offload = None if resident is None else install_expert_offload(model, resident, stats_path, every)
    engine = _engine(model, Tokenizer.from_dir(checkpoint))
    outputs = run_all(engine, random_prompts(12, seed=3), GREEDY)
    return [out.outputs[0].token_ids for out in outputs], engine, offload


@pytest.mark.parametrize("resident", [0, 3, 7])
def test_v4_any_expert_budget_gives_the_all_resident_tokens(tiny_checkpoint, resident):
    expected, _, _ = _greedy_tokens(tiny_checkpoint, None)
    tokens, engine, offload = _greedy_tokens(tiny_checkpoint, resident)
    assert engine.scheduler.num_preemptions > 0  # the small cache forced recomputation
    assert tokens == expected
    assert offload.arena.fetched_experts > 0 and offload.steps >= 6  # misses were fetched; re-balances ran
    assert offload.hit_rate() < 1.0
    offload.rebalance()
    assert all(len(layer.resident) == resident for layer in offload.layers)


def test_v41_any_expert_budget_gives_the_all_resident_tokens(tiny_v41_checkpoint):
    expected, _, _ = _greedy_tokens(tiny_v41_checkpoint, None)
    for resident in (0, 5):
        tokens, _, offload = _greedy_tokens(tiny_v41_checkpoint, resident, every=2)
        assert tokens == expected
        assert offload.arena.fetched_experts > 0


def test_a_rebalance_mid_request_moves_experts_and_keeps_the_tokens(tiny_checkpoint, tmp_path):
    """Counts gathered while serving make the most-routed experts resident between steps of running requests."""
    expected, _, _ = _greedy_tokens(tiny_checkpoint, None)
    model = load_model(tiny_checkpoint, progress=False)
    offload = install_expert_offload(model, 4, tmp_path / "stats.json", rebalance_every=10**9)
    engine = _engine(model, Tokenizer.from_dir(tiny_checkpoint))
    ids = [engine.add_request(p, GREEDY) for p in random_prompts(12, seed=3)]
    results, moved = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].token_ids
        if engine.has_unfinished_requests():
            moved += offload.rebalance()  # between every two steps, requests in flight
    assert moved > 0
    assert [results[i] for i in ids] == expected
    for layer in offload.layers:  # resident: the layer's most-routed experts
        counts = offload.stats.counts[layer.row].tolist()
        top = sorted(range(8), key=lambda e: (-counts[e], e))[:4]
        assert layer.resident == sorted(top)


def test_stats_round_trip_and_the_even_split_of_a_first_run(tiny_checkpoint, tmp_path):
    path = tmp_path / "stats.json"
    model = load_model(tiny_checkpoint, progress=False)
    first = install_expert_offload(model, 4, path)
    assert not path.exists()
    assert [layer.resident for layer in first.layers] == [[0, 2, 4, 6]] * len(first.layers)  # even over the ids
    run_all(_engine(model, Tokenizer.from_dir(tiny_checkpoint)), random_prompts(4, seed=5), GREEDY)
    first.rebalance()  # writes the counts
    saved = json.loads(path.read_text())
    assert saved["layers"] == {str(i): row for i, row in zip(first.stats.layer_ids, first.stats.counts.tolist(),
                                                            strict=True)}  # fmt: skip
    again = install_expert_offload(load_model(tiny_checkpoint, progress=False), 4, path)
    assert torch.equal(again.stats.counts, first.stats.counts)
    assert [layer.resident for layer in again.layers] == [layer.resident for layer in first.layers]
    saved["n_routed_experts"] = 16
    path.write_text(json.dumps(saved))
    with pytest.raises(ExpertStatsError, match="field 'n_routed_experts': 16"):
        install_expert_offload(load_model(tiny_checkpoint, progress=False), 4, path)


def test_engine_option_and_budget(tiny_checkpoint):
    assert resident_for_budget(80_000 / 2**30, 4, 8, 3264) == 4  # 2 r + 16 experts of 3,264 bytes in 80,000
    with pytest.raises(ConfigError, match="cannot hold even the fetch buffers"):
        resident_for_budget(40_000 / 2**30, 4, 8, 3264)
    with pytest.raises(ConfigError, match="expert_offload"):
        EngineConfig(expert_offload="most")
    model = load_model(tiny_checkpoint, progress=False, expert_device="cpu")
    expert_bytes = model.layers[0].ffn.routed_weights().nbytes // 8
    budget = (2 * 5 + 16) * expert_bytes / 2**30  # 4 layers: 5 resident each plus 2 x 3 fetch slots = 26 experts
    offload_experts(model, EngineConfig(expert_offload=budget))
    assert [len(layer.resident) for layer in model.expert_offload.layers] == [5] * 4


@pytest.mark.parametrize(("resident", "ahead"), [(0, True), (3, True), (4, False), (7, False)])
def test_fetch_ahead_is_on_by_default_only_where_few_experts_are_resident(tiny_checkpoint, resident, ahead):
    """Of 8 experts a layer: on below half resident (FETCH_AHEAD_BELOW_RESIDENT_SHARE), unless the caller says."""
    offload = install_expert_offload(load_model(tiny_checkpoint, progress=False), resident)
    assert (offload.layers[0].next_layer is not None) == ahead
    forced = install_expert_offload(load_model(tiny_checkpoint, progress=False), resident, fetch_ahead=True)
    assert forced.layers[0].next_layer is not None


def test_a_background_rebalance_moves_a_few_experts_a_layer_and_converges(tiny_checkpoint):
    """Between steps the engine swaps at most REBALANCE_MOVES_PER_LAYER experts a layer (service waits on the
    copies); repeated re-balances reach the most-routed set, and the tokens stay the all-resident ones."""
    expected, _, _ = _greedy_tokens(tiny_checkpoint, None)
    tokens, _, offload = _greedy_tokens(tiny_checkpoint, 2, every=10**9)  # no re-balance while serving
    assert tokens == expected
    offload.stats.snapshot()
    targets = [offload.stats.resident(layer.row, 2) for layer in offload.layers]
    before = [list(layer.resident) for layer in offload.layers]
    moved = offload.rebalance(1)
    assert moved == sum(len(set(t) - set(b)) > 0 for t, b in zip(targets, before, strict=True))
    for layer, start in zip(offload.layers, before, strict=True):
        assert len(set(layer.resident) - set(start)) <= 1
    while offload.rebalance(1):
        pass
    assert [layer.resident for layer in offload.layers] == targets
