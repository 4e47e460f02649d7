"""``dsinfer plan``: the tensor table against the real model, three placements against figures worked by hand."""

from __future__ import annotations

import inspect
import re
from dataclasses import replace

import pytest
import torch

from dsinfer.bench.shapes import write_slice_directory
from dsinfer.cli import main
from dsinfer.config import ModelConfig, QuantizationConfig
from dsinfer.config.tensor_shapes import model_tensors
from dsinfer.memory_plan import (
    GIB,
    MIB,
    PlanError,
    PlanRequest,
    build_plan,
    gpu_memory_bytes,
    plan_config,
    plan_lines,
    weight_bytes,
)
from dsinfer.models.deepseek_v4 import DeepseekV4
from dsinfer.models.deepseek_v41 import DeepseekV41
from dsinfer.models.tiny import tiny_config, tiny_config_v41
from dsinfer.offload import install_expert_offload

H100, H200 = 81559 * MIB, 143771 * MIB
V4_EXPERT = 3 * 2048 * 4096 // 2 + 3 * 2048 * 4096 // 32  # packed e2m1 codes + one ue8m0 byte per 32 inputs
V41_EXPERT = 3 * 2304 * 5120 // 2 + 3 * 2304 * 5120 // 32


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_tensor_table_matches_the_model(arch):
    """Every name and element count of the table equals a model built on the meta device, drafter included."""
    config, model_class = (tiny_config(), DeepseekV4) if arch == "v4" else (tiny_config_v41(), DeepseekV41)
    with torch.device("meta"):
        model = model_class(config)
    built: dict[str, int] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        name = re.sub(r"(ffn\.experts)\.\d+\.w[123]\.weight$", r"\1", name)  # the table stacks a layer's experts
        name = re.sub(r"engram\.embed\.scale$", "engram.embed.weight", name)  # and counts a table's scales with it
        built[name] = built.get(name, 0) + tensor.numel()
    table = {}
    for tensor in model_tensors(config, with_drafter=True):
        scales = tensor.numel // config.engram_head_dim if tensor.storage == "engram" else 0
        table[tensor.name] = tensor.numel + scales
    assert table == built


def v4_flash_attention_bytes() -> int:
    """V4-Flash's attention, mHC and norms over 43 layers in bf16 (FP8 linears dequantised), by hand."""
    linears = 1024 * 4096 + 32768 * 1024 + 512 * 4096 + 8192 * 4096 + 4096 * 8192  # wq_a wq_b wkv wo_a wo_b
    small = 2 * (24 * 16384 + 24 + 3) + 2 * 4096 + 64 + 1024 + 512  # hc fn/base/scale x2, 2 norms, sinks, q/kv norm
    every = 2 * linears + 4 * small
    csa = 4 * 4 * 1024 + 2 * 2 * 1024 * 4096 + 4 * 512  # compressor: ape, wkv + wgate (twice the width), norm
    csa += 2 * 8192 * 1024 + 2 * 64 * 4096  # indexer wq_b, weights_proj
    csa += 4 * 4 * 256 + 2 * 2 * 256 * 4096 + 4 * 128  # the indexer's own compressor
    hca = 4 * 128 * 512 + 2 * 2 * 512 * 4096 + 4 * 512
    return 43 * every + 21 * csa + 20 * hca


def v4_flash_sequence_bytes(tokens: int) -> int:
    """One 8,192-token-aligned sequence's bf16 cache: 2 window, 21 CSA, 20 HCA layers."""
    window = 128 * 512 * 2
    csa = window + 4 * 4 * 2 * (512 + 128) * 2 + tokens // 4 * (512 + 128) * 2
    hca = window + 2 * 128 * 512 * 2 + tokens // 128 * 512 * 2
    return 2 * window + 21 * csa + 20 * hca


def test_v4_flash_weights_by_hand():
    config, _ = plan_config("deepseek-v4-flash")
    weights = weight_bytes(PlanRequest(config))
    assert weights.expert == V4_EXPERT == 13_369_344
    assert weights.routed == 43 * 256 * V4_EXPERT  # about 147 GB, the release's bulk
    assert weights.attention == v4_flash_attention_bytes()
    hash_tables = 3 * 129280 * 6 * 4
    shared = 3 * 2048 * 4096 * 2
    assert weights.dense_ffn == 43 * (256 * 4096 * 2 + shared) + 40 * 256 * 4 + hash_tables
    assert weights.ends == 2 * 129280 * 4096 * 2 + 4096 * 4 + 4 * (4 * 16384 + 4 + 1)


def test_make_slice_declares_the_formats_its_dummy_weights_draw(tmp_path):
    """The served slice's start-up plan sizes its experts as the dummy weights store them (packed FP4), not as
    16-bit tensors (which had the plan call a 43-layer slice 482 GiB of host store where 97 GiB were used)."""
    config = ModelConfig.from_file(write_slice_directory(tmp_path, 3) / "config.json")
    assert config.quantization == QuantizationConfig()
    assert weight_bytes(PlanRequest(config)).expert == V4_EXPERT


def test_v4_flash_on_one_h100_offloads_by_hand():
    """1 x H100, auto: the cache gets 8 sequences of 8,192 tokens, the experts the rest (with a fetch pool of two
    buffers of one layer's misses)."""
    config, label = plan_config("deepseek-v4-flash")
    request = PlanRequest(config, gpus=1, gpu_memory=H100, host_memory=512 * GIB, max_model_len=8192,
                          max_num_seqs=8, expert_offload="auto")  # fmt: skip
    plan = build_plan(request, label, "H100")
    weights = weight_bytes(request)
    fixed = weights.ends + weights.attention + weights.dense_ffn
    per_sequence = v4_flash_sequence_bytes(8192)
    assert plan.per_sequence == per_sequence
    budget = int(H100 * 0.9) - fixed - 8 * per_sequence
    resident = (budget - 2 * 256 * V4_EXPERT) // ((43 - 2) * V4_EXPERT)  # 43 r + 2 (256 - r) experts fit
    assert plan.experts.resident == resident and 0 < resident < 256
    assert plan.experts.fetch_slots == 2 * (256 - resident)
    assert plan.host_bytes == 43 * (256 - resident) * V4_EXPERT  # the engine's store: the offloaded experts only
    experts_on_gpu = (43 * resident + 2 * (256 - resident)) * V4_EXPERT
    assert plan.sequences_per_gpu == (int(H100 * 0.9) - fixed - experts_on_gpu) // per_sequence
    assert plan.shortfalls() == []
    plan.check()


def test_v41_flash_on_eight_h200_by_hand():
    """8 x H200, no offload: 48 experts per layer per GPU, the Engram tables in host memory (they exceed a
    quarter of the GPU), FP8 / FP4 cache codes."""
    config, label = plan_config("deepseek-v4.1-flash")
    request = PlanRequest(config, gpus=8, gpu_memory=H200, host_memory=1024 * GIB, max_model_len=16384)
    plan = build_plan(request, label, "H200")
    assert plan.experts.per_layer == 48 and plan.experts.resident == 48 and plan.experts.fetch_slots == 0
    assert plan.weights.expert == V41_EXPERT
    assert plan.engram == "host" and plan.engram_gpu_bytes == 0
    assert plan.host_bytes == (384_006_168 + 384_016_682) * (256 + 8)  # FP8 rows and a ue8m0 byte per 32
    window = 128 * (512 + 16)
    entry = (256 + 32) + (64 + 4)  # FP4 KV (e4m3 per 16) + FP4 index key (ue8m0 per 32)
    ratio2_source = window + 2 * 2 * 512 * 4 + 16384 // 2 * entry
    ratio1_source = window + 16384 * entry
    assert plan.per_sequence == 36 * window + 3 * ratio2_source + ratio1_source + 3 * 8
    gpu_weights = plan.fixed_gpu_bytes + 40 * 48 * V41_EXPERT
    assert plan.sequences_per_gpu == (int(H200 * 0.9) - gpu_weights) // plan.per_sequence
    plan.check()


def test_tiny_gib_budget_by_hand():
    """A GiB expert budget on the tiny V4 config: 8 experts of 3,264 bytes per layer, 4 layers."""
    expert = 3 * 32 * 64 // 2 + 3 * 32 * 64 // 32
    request = PlanRequest(tiny_config(), gpu_memory=GIB, host_memory=GIB, expert_offload=80_000 / GIB)
    plan = build_plan(request)
    assert plan.weights.expert == expert == 3264
    # 4 r + 2 (8 - r) = 2 r + 16 experts within 80,000 bytes: r = 4 (24 experts, 78,336 bytes); r = 5 needs 84,864
    assert plan.experts.resident == 4 and plan.experts.gpu_bytes == 24 * expert
    assert plan.shortfalls() == []
    too_small = build_plan(PlanRequest(tiny_config(), gpu_memory=GIB, host_memory=GIB, expert_offload=40_000 / GIB))
    assert too_small.expert_budget_short == 16 * expert - 40_000  # not even the fetch pool (2 x 8 slots) fits
    with pytest.raises(PlanError, match="cannot hold even the fetch pool"):
        too_small.check()


def test_a_plan_that_cannot_fit_names_the_shortfall(capsys):
    config, label = plan_config("deepseek-v4-flash")
    plan = build_plan(PlanRequest(config, gpu_memory=H100, host_memory=512 * GIB), label, "H100")
    need = plan.gpu_weight_bytes + 16 * plan.per_sequence - int(H100 * 0.9)
    with pytest.raises(PlanError, match=rf"1 x H100: each GPU is short by {need / GIB:.1f} GiB.*--expert-offload auto"):
        plan.check()
    assert main(["plan", "deepseek-v4-flash", "--gpu-memory", "h100", "--host-memory", "512"]) == 2
    captured = capsys.readouterr()
    assert "routed experts: 256 of 256 per layer" in captured.out
    assert f"short by {need / GIB:.1f} GiB" in captured.err
    host_short = PlanRequest(config, gpu_memory=H100, host_memory=64 * GIB, expert_offload="auto")
    with pytest.raises(PlanError, match="host memory is short by"):
        build_plan(host_short).check()


def test_cli_plans_a_checkpoint_directory_and_rejects_bad_input(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v4", "num_hidden_layers": 4}')
    assert main(["plan", str(tmp_path), "--gpu-memory", "80", "--gpus", "2", "--host-memory", "64"]) == 0
    out = capsys.readouterr().out
    assert "on 2 x 80 GiB GPU" in out and "verdict: fits" in out and "128 of 128 per layer x 4" in out
    assert main(["plan", "no-such-model"]) == 2
    assert "not a checkpoint directory or config.json, nor a release name" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--gpu-memory"):
        gpu_memory_bytes("a100")
    with pytest.raises(SystemExit):
        main(["plan", "deepseek-v4-flash", "--expert-offload", "lots"])


def test_a_host_store_of_the_offloaded_experts_only_by_hand():
    """V4-Flash on 1 x H100 beside 128 GiB of host memory: a store of every expert (147 GB) does not fit the host;
    the engine's default store of only the offloaded experts counts those alone, and the printout says which."""
    config, label = plan_config("deepseek-v4-flash")
    offloaded_request = PlanRequest(config, gpus=1, gpu_memory=H100, host_memory=128 * GIB, max_model_len=8192,
                                    max_num_seqs=8, expert_offload="auto")  # fmt: skip
    engine_default = inspect.signature(install_expert_offload).parameters["host_keeps_every_expert"].default
    assert not offloaded_request.host_keeps_every_expert and not engine_default  # the plan assumes the engine's
    every = replace(offloaded_request, host_keeps_every_expert=True)
    default_plan = build_plan(every, label, "H100")
    assert default_plan.host_bytes == 43 * 256 * V4_EXPERT
    with pytest.raises(PlanError, match="host memory is short by"):
        default_plan.check()
    assert any("routed experts (every expert, checkpoint form)" in line for line in plan_lines(default_plan))
    offloaded_only = build_plan(replace(every, host_keeps_every_expert=False), label, "H100")
    resident = offloaded_only.experts.resident
    assert resident == default_plan.experts.resident and 0 < resident < 256  # the GPU side does not change
    assert offloaded_only.host_bytes == 43 * (256 - resident) * V4_EXPERT
    assert any("routed experts (offloaded only, checkpoint form)" in line for line in plan_lines(offloaded_only))
    offloaded_only.check()
    tiny = PlanRequest(tiny_config(), gpu_memory=GIB, host_memory=GIB, expert_offload=80_000 / GIB,
                       host_keeps_every_expert=False)  # fmt: skip
    assert build_plan(tiny).host_bytes == 4 * (8 - 4) * 3264  # 4 layers, 4 of 8 experts offloaded
