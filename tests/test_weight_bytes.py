"""Weights stay in checkpoint precision: loaded bytes against the bytes the checkpoint's tensors hold."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsinfer.layers.moe import MoE
from dsinfer.models.expert_packing import weight_bytes
from dsinfer.models.loader import load_model
from dsinfer.models.native_random import build_native_model
from dsinfer.models.tiny import tiny_config

ROUTED = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.(weight|scale)$")


def _checkpoint_bytes(directory: Path) -> dict[str, int]:
    """Bytes of the tensors stored in the shards: routed experts (codes and scales) and everything."""
    routed = total = 0
    for shard in directory.glob("*.safetensors"):
        with safe_open(shard, "pt") as handle:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                size = tensor.numel() * tensor.element_size()
                total += size
                routed += size if ROUTED.search(key) else 0
    return {"routed_experts": routed, "all": total}


@pytest.mark.parametrize("checkpoint", ["tiny_checkpoint", "tiny_v41_checkpoint"])
def test_loaded_weights_stay_near_their_checkpoint_bytes(checkpoint, request):
    directory = Path(request.getfixturevalue(checkpoint))
    stored = _checkpoint_bytes(directory)
    model = load_model(directory, dtype=torch.bfloat16, progress=False)
    loaded = weight_bytes(model)
    assert all(
        module.is_packed and module.routed_weights().is_fp4 for module in model.modules() if isinstance(module, MoE)
    )
    assert loaded["routed_experts"] <= 1.10 * stored["routed_experts"], (loaded, stored)
    assert loaded["all"] <= 1.30 * stored["all"], (loaded, stored)


def test_native_random_model_has_packed_experts_of_checkpoint_size():
    """The benchmark builder's experts are exactly the bytes a release checkpoint stores for them."""
    config = tiny_config()
    model = build_native_model(config, torch.bfloat16, "cpu")
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size
    expected = config.num_hidden_layers * config.n_routed_experts * (per_expert // 2 + per_expert // 32)
    assert weight_bytes(model)["routed_experts"] == expected


def test_fp8_linears_kept_or_dequantised_give_the_same_logits(tiny_checkpoint):
    from dsinfer.kv.batch import PackedBatch
    from dsinfer.layers.fp8_linear import Fp8Linear

    kept = load_model(tiny_checkpoint, progress=False, fp8_linears="keep")
    dense = load_model(tiny_checkpoint, progress=False, fp8_linears="dequantize")
    assert any(isinstance(m, Fp8Linear) for m in kept.modules())
    assert not any(isinstance(m, Fp8Linear) for m in dense.modules())
    assert weight_bytes(kept)["all"] < weight_bytes(dense)["all"]
    batch = [list(range(3, 70))]
    assert torch.equal(kept(PackedBatch.from_sequences(batch)), dense(PackedBatch.from_sequences(batch)))


def test_an_unknown_fp8_policy_is_an_error(tiny_checkpoint):
    with pytest.raises(ValueError, match="fp8_linears"):
        load_model(tiny_checkpoint, progress=False, fp8_linears="fp16")
