"""``--load-format dummy`` with ``--expert-offload``: random experts drawn where the offload keeps them (the backbone's
resident ones in their device slots, the rest straight into the host store; the drafter's on the device), so a
full-depth V4-Flash of random weights never holds all its experts in host memory at once."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from engine_harness import random_prompts, run_all

from dsinfer.config import EngineConfig
from dsinfer.config.expert_split import FETCH_BUFFERS
from dsinfer.engine.engine import LLMEngine
from dsinfer.layers.moe import MoE
from dsinfer.models import native_random
from dsinfer.parallel.engine_loop import load_engine_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 48, "max_model_len": 128, "num_cache_blocks": 12}


def _config_only(checkpoint: str, directory: Path) -> Path:
    directory.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (Path(checkpoint) / name).exists():
            shutil.copy(Path(checkpoint) / name, directory / name)
    return directory


def _tokens(model, directory: Path, speculative: dict | None = None) -> list[list[int]]:
    config = EngineConfig(**ENGINE, speculative_config=speculative)
    engine = LLMEngine(model, Tokenizer.from_dir(directory), config)
    return [out.outputs[0].token_ids for out in run_all(engine, random_prompts(6, seed=5), GREEDY)]


def _budget_for(resident: int, layers: int, experts: int, expert_bytes: int) -> float:
    return (layers * resident + FETCH_BUFFERS * (experts - resident)) * expert_bytes / 2**30


def _meta_experts(model) -> list[str]:
    return [name for name, module in model.named_modules()
            if isinstance(module, MoE) and module.routed_weights().w13.device.type == "meta"
            and module.expert_residency is None]  # fmt: skip


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_random_experts_are_drawn_into_the_offloads_slots_and_host_rows(arch, tiny_checkpoint, tiny_v41_checkpoint,
                                                                        tmp_path, monkeypatch):  # fmt: skip
    directory = _config_only(tiny_checkpoint if arch == "v4" else tiny_v41_checkpoint, tmp_path / "shape")
    everything = load_engine_model(directory, EngineConfig(**ENGINE, expert_offload=1024.0), load_format="dummy")
    assert everything.expert_offload is None and not _meta_experts(everything)  # all fit: all on the device
    weights = everything.layers[-1].ffn.routed_weights()
    layers = sum(isinstance(block.ffn, MoE) for block in everything.layers)
    budget = _budget_for(3, layers, weights.num_experts, weights.nbytes // weights.num_experts)
    stacks_drawn = []  # the device of every stack of random experts drawn whole
    whole = native_random.random_fp4_experts

    def recorded(n_experts, hidden, intermediate, device, generator):
        stacks_drawn.append(torch.device(device).type)
        return whole(n_experts, hidden, intermediate, device, generator)

    monkeypatch.setattr(native_random, "random_fp4_experts", recorded)
    runs = []
    for _ in range(2):
        stacks_drawn.clear()
        model = load_engine_model(directory, EngineConfig(**ENGINE, expert_offload=budget), load_format="dummy")
        offload = model.expert_offload
        assert [len(layer.resident) for layer in offload.layers] == [3] * layers
        assert all(layer.host.weights.num_experts == weights.num_experts - 3 for layer in offload.layers)
        assert not _meta_experts(model)  # the drafter's experts drawn on the device, the backbone's in place
        drafters = sum(isinstance(module, MoE) for module in model.modules()) - layers
        assert stacks_drawn.count("cpu") == drafters  # no backbone layer's experts ever drawn whole in host memory
        runs.append(_tokens(model, directory))
        assert offload.arena.fetched_experts > 0
    assert runs[0] == runs[1] and all(len(tokens) == 8 for tokens in runs[0])  # seeded: the same weights each time


def test_a_drafter_drafts_from_its_drawn_experts(tiny_checkpoint, tmp_path):
    directory = _config_only(tiny_checkpoint, tmp_path / "shape")
    shapes = load_engine_model(directory, EngineConfig(**ENGINE, expert_offload=1024.0), load_format="dummy")
    weights = shapes.layers[-1].ffn.routed_weights()
    budget = _budget_for(2, len(shapes.layers), weights.num_experts, weights.nbytes // weights.num_experts)
    model = load_engine_model(directory, EngineConfig(**ENGINE, expert_offload=budget), load_format="dummy")
    assert model.mtp[0].ffn.routed_weights().w13.device == torch.device("cpu")
    plain = _tokens(model, directory)
    assert _tokens(model, directory, {"method": "mtp", "num_speculative_tokens": 2}) == plain
