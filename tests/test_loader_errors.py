"""Every way a checkpoint directory can be broken gives one error that names the culprit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsinfer.models.loader import INDEX_FILE, CheckpointError, load_model


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, target)
    return target


def _shard_holding(directory, tensor_name):
    weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    return directory / weight_map[tensor_name]


def _rewrite_shard(directory, tensor_name, edit):
    """Load the shard holding ``tensor_name``, let ``edit`` change its dict, save it back."""
    shard = _shard_holding(directory, tensor_name)
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, str(shard))


def test_intact_checkpoint_loads(checkpoint):
    model = load_model(checkpoint, progress=False)
    assert model.layers[1].attn.wq_a.weight.dtype == torch.float32


def test_missing_tensor_is_named(checkpoint):
    name = "layers.1.attn.compressor.wgate.weight"
    _rewrite_shard(checkpoint, name, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) 'layers\.1\.attn\.compressor\.wgate\.weight'"):
        load_model(checkpoint, progress=False)


def test_unexpected_tensor_is_named(checkpoint):
    name = "layers.1.attn.wq_a.weight"
    _rewrite_shard(checkpoint, name, lambda t: t.update({"layers.1.attn.bogus.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'layers\.1\.attn\.bogus\.weight'"):
        load_model(checkpoint, progress=False)


def test_wrongly_shaped_tensor_is_named(checkpoint):
    name = "layers.0.attn.kv_norm.weight"
    _rewrite_shard(checkpoint, name, lambda t: t.update({name: torch.ones(7)}))
    with pytest.raises(
        CheckpointError, match=r"tensor 'layers\.0\.attn\.kv_norm\.weight': shape \(7,\), expected \(64,\)"
    ):
        load_model(checkpoint, progress=False)


def test_wrongly_shaped_fp8_scale_is_named(checkpoint):
    name = "layers.2.attn.wq_b.weight"
    _rewrite_shard(
        checkpoint, name, lambda t: t.update({"layers.2.attn.wq_b.scale": t["layers.2.attn.wq_b.scale"].repeat(2, 1)})
    )
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.2\.attn\.wq_b\.weight': FP8 weight"):
        load_model(checkpoint, progress=False)


def test_wrongly_shaped_fp4_expert_is_named(checkpoint):
    name = "layers.3.ffn.experts.5.w2.weight"
    _rewrite_shard(checkpoint, name, lambda t: t.update({name: t[name][:, :4].contiguous()}))
    with pytest.raises(CheckpointError, match=r"tensor 'layers\.3\.ffn\.experts\.5\.w2\.weight': FP4 weight"):
        load_model(checkpoint, progress=False)


def test_truncated_shard_is_named(checkpoint):
    shard = _shard_holding(checkpoint, "embed.weight")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=rf"{shard.name}: .*truncated"):
        load_model(checkpoint, progress=False)


def test_shard_with_broken_header_is_named(checkpoint):
    shard = _shard_holding(checkpoint, "embed.weight")
    shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match=rf"{shard.name}: unreadable or truncated"):
        load_model(checkpoint, progress=False)


def test_missing_index_file_is_named(checkpoint):
    (checkpoint / INDEX_FILE).unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: missing index file"):
        load_model(checkpoint, progress=False)


def test_shard_missing_from_disk_is_named(checkpoint):
    shard = _shard_holding(checkpoint, "head.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name}: shard listed in .* is missing"):
        load_model(checkpoint, progress=False)


def test_missing_config_is_named(checkpoint):
    (checkpoint / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: file not found"):
        load_model(checkpoint, progress=False)


def test_bad_config_value_is_named(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["num_experts_per_tok"] = 99
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"field 'num_experts_per_tok': 99 exceeds n_routed_experts"):
        load_model(checkpoint, progress=False)


def test_not_a_directory(tmp_path):
    with pytest.raises(
        CheckpointError, match=r"nowhere: file not found \(a checkpoint directory needs a config\.json\)"
    ):
        load_model(tmp_path / "nowhere", progress=False)
