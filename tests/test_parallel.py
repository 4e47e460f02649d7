"""The multi-rank layout's checks, the expert placement, request balancing and the EP dispatch path in-process."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dsinfer.config import ConfigError, EngineConfig, ModelConfig
from dsinfer.kv.batch import PackedBatch
from dsinfer.models.loader import load_model
from dsinfer.parallel.config import ParallelConfig
from dsinfer.parallel.dp import RequestBalancer
from dsinfer.parallel.ep import ExpertParallel, ExpertPlacement, backbone_expert_filter, run_idle_pass
from dsinfer.parallel.ranked_engine import check_layout


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"data_parallel_size": 2, "expert_parallel_size": 4}, r"got 2 x 1 != 4"),
        ({"data_parallel_size": 2, "expert_parallel_size": 4, "context_parallel_size": 2}, "context parallelism"),
        ({"data_parallel_size": 0}, "--data-parallel-size must be an integer of at least 1"),
        ({"data_parallel_size": 2, "expert_parallel_size": 2, "nnodes": 2}, "--master-port is required"),
        ({"data_parallel_size": 4, "expert_parallel_size": 4, "nnodes": 3, "master_port": 1234}, "must divide"),
        ({"nnodes": 2, "node_rank": 2, "master_port": 1234, "data_parallel_size": 2, "expert_parallel_size": 2},
         "--node-rank must lie in"),
    ],
)  # fmt: skip
def test_bad_layouts_get_one_clear_message(options, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**options)


def test_layout_checks_against_the_model_and_the_gpus_before_loading(tiny_checkpoint, tmp_path):
    model_config = ModelConfig.from_file(tiny_checkpoint)  # 8 routed experts
    three = ParallelConfig(3, 3)
    with pytest.raises(ConfigError, match=r"--expert-parallel-size 3 must divide the model's n_routed_experts \(8\)"):
        check_layout(three, model_config, EngineConfig())
    with pytest.raises(ConfigError, match="4 ranks per host .* need as many GPUs, but this host has 2"):
        ParallelConfig(4, 4).check_devices("cuda", 2)
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"ranks": [[0, 1, 2], [3, 4, 5, 6]]}))
    with pytest.raises(ConfigError, match=r"experts \[7\] are held by no rank"):
        check_layout(ParallelConfig(2, 2, expert_placement=str(placement)), model_config, EngineConfig())
    placement.write_text(json.dumps({"ranks": [[0, 1, 2, 3, 4]]}))
    with pytest.raises(ConfigError, match="lists 1 ranks for --expert-parallel-size 2"):
        check_layout(ParallelConfig(2, 2, expert_placement=str(placement)), model_config, EngineConfig())
    placement.write_text("{")
    with pytest.raises(ConfigError, match="expert placement file"):
        check_layout(ParallelConfig(2, 2, expert_placement=str(placement)), model_config, EngineConfig())
    speculative = EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    check_layout(ParallelConfig(2, 2), model_config, speculative)  # data-parallel ranks speculate too


def test_placement_describes_redundant_experts():
    placement = ExpertPlacement(8, ((0, 1, 2, 3, 4), (3, 4, 5, 6, 7)))
    placement.validate(2)
    assert placement.is_redundant and placement.describe() == ("8 experts + 2 redundant over 2 ranks, per rank [5, 5]")
    assert ExpertPlacement.contiguous(8, 4).rank_experts[1] == (2, 3)


def test_balancer_prefers_the_least_busy_rank_and_keeps_prefix_affinity():
    balancer = RequestBalancer(2, block_tokens=4, affinity_slack_tokens=10)
    shared = list(range(100, 108))
    assert balancer.choose(shared + [1]) == 0
    balancer.assign(0, shared + [1], 9)
    assert balancer.choose([5, 6, 7]) == 1  # rank 0 is busier
    assert balancer.choose(shared + [2, 3]) == 0  # holds the first two blocks, within the slack
    balancer.assign(0, [9] * 30, 30)
    assert balancer.choose(shared + [2, 3]) == 1  # now too busy for affinity to win
    balancer.release(0, 39)
    assert balancer.inflight_tokens == [0, 0]


def test_expert_parallel_path_matches_the_plain_moe_in_one_process(tiny_checkpoint):
    """EP = 1 without collectives: the dispatch, the one-expert-per-row compute and the combine give the plain
    layer's logits; an idle pass runs every sharded layer once with no tokens."""
    plain = load_model(tiny_checkpoint)
    sharded = load_model(tiny_checkpoint, owned_experts=backbone_expert_filter(ExpertPlacement.contiguous(8, 1), 0))
    dispatcher = ExpertParallel(ExpertPlacement.contiguous(8, 1), 0, None, "cpu")
    layers = dispatcher.attach(sharded)
    assert len(layers) == sharded.config.num_hidden_layers
    prompts = [[5, 9, 33, 41, 7, 8], [12, 13, 99]]
    expected = plain(PackedBatch.from_sequences(prompts))
    got = sharded(PackedBatch.from_sequences(prompts))
    assert dispatcher.calls == len(layers)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    dispatcher.calls = 0
    run_idle_pass(sharded, "cpu")
    assert dispatcher.calls == len(layers)


def test_an_ep_rank_loads_only_its_experts(tiny_checkpoint):
    placement = ExpertPlacement(8, ((0, 1, 2, 3, 4), (3, 4, 5, 6, 7)))
    model = load_model(tiny_checkpoint, owned_experts=backbone_expert_filter(placement, 1))
    full = load_model(tiny_checkpoint)
    local = model.layers[0].ffn.routed_weights()
    assert local.num_experts == 5
    torch.testing.assert_close(local.w2[0], full.layers[0].ffn.routed_weights().w2[3], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--data-parallel-size", "2", "--expert-parallel-size", "4"], "got 2 x 1 != 4"),
        (["--data-parallel-size", "3", "--expert-parallel-size", "3"], "must divide the model's n_routed_experts"),
        (["--data-parallel-size", "2", "--expert-parallel-size", "2", "--device", "cuda"], "CUDA|GPUs"),
    ],
)
def test_serve_refuses_a_bad_layout_with_one_message_before_loading(tiny_checkpoint, capsys, flags, message):
    from dsinfer.cli import main

    assert main(["serve", str(tiny_checkpoint), "--port", "1", *flags]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("dsinfer serve: error:")
    assert re.search(message, error[0]), error[0]
