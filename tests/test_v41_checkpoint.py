"""DeepSeek-V4.1 checkpoints: `make-tiny --arch v41` writes the release's formats; the loader reads official and
Hugging Face names, keeps the Engram tables in FP8, and names the culprit when something is wrong."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsinfer.cli import main
from dsinfer.config import ModelConfigV41
from dsinfer.engram.vocabulary import build_compressed_vocabulary
from dsinfer.kv.batch import PackedBatch
from dsinfer.models.deepseek_v41 import DeepseekV41
from dsinfer.models.loader import INDEX_FILE, CheckpointError, load_model
from dsinfer.tokenizer import Tokenizer


@pytest.fixture
def checkpoint(tiny_v41_checkpoint, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_v41_checkpoint, target)
    return target


def _stored(directory) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    out = {}
    for shard in sorted(set(weight_map.values())):
        with safe_open(directory / shard, "pt") as handle:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                out[key] = (tensor.dtype, tuple(tensor.shape))
    return out


def _rewrite_shard(directory, tensor_name, edit):
    weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
    shard = directory / weight_map[tensor_name]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, str(shard))


def test_make_tiny_v41_writes_the_release_formats(tmp_path, capsys):
    directory = tmp_path / "tiny41"
    assert main(["make-tiny", str(directory), "--arch", "v41", "--shards", "2"]) == 0
    assert "V4.1" in capsys.readouterr().out
    raw = json.loads((directory / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v41" and raw["text_config"]["engram_layer_ids"] == [1, 6]
    vocabulary = build_compressed_vocabulary(Tokenizer.from_dir(directory))
    assert raw["text_config"]["engram_compressed_vocab_size"] == int(vocabulary.max()) + 1 < 512
    stored = _stored(directory)
    # FP8 linears with one ue8m0 scale per 32 x 32 block
    assert stored["layers.3.attn.wq_b.weight"] == (torch.float8_e4m3fn, (256, 32))
    assert stored["layers.3.attn.wq_b.scale"] == (torch.float8_e8m0fnu, (8, 1))
    assert stored["layers.6.engram.wkv.weight"][0] == torch.float8_e4m3fn
    # FP4 routed experts, two codes per byte, one scale per 32 inputs
    assert stored["layers.2.ffn.experts.3.w1.weight"] == (torch.int8, (32, 32))
    assert stored["layers.2.ffn.experts.3.w1.scale"] == (torch.float8_e8m0fnu, (32, 2))
    # Engram table rows: FP8 + one scale per 32 channels of each row
    rows = ModelConfigV41.from_dict(raw).engram_num_embeddings[0]
    assert stored["layers.1.engram.embed.weight"] == (torch.float8_e4m3fn, (rows, 32))
    assert stored["layers.1.engram.embed.scale"] == (torch.float8_e8m0fnu, (rows, 1))
    # role-dependent tensors: keys only on KV sources, gates only above ratio 1, bias_vl everywhere
    assert "layers.5.attn.indexer.wk.weight" in stored and "layers.7.attn.indexer.wk.weight" not in stored
    assert "layers.7.attn.indexer.wq_b.weight" in stored and "layers.6.attn.indexer.wq_b.weight" not in stored
    assert "layers.1.attn.compressor.wgate.weight" in stored and "layers.5.attn.compressor.wgate.weight" not in stored
    assert stored["layers.1.attn.compressor.wkv.weight"][0] == torch.float32  # fp32 above ratio 1
    assert stored["layers.0.ffn.gate.bias_vl"] == (torch.float32, (8,))
    assert not any(".tid2eid" in k or "hc_head" in k or ".ape" in k for k in stored)
    # DSpark: stage 0 reads the targets, the last stage owns the heads
    assert stored["mtp.0.main_proj.weight"][1] == (64, 3 * 64)
    assert stored["mtp.1.markov_head.embed.weight"][1] == (512, 8)
    assert stored["mtp.1.confidence_head.proj.weight"][1] == (1, 64 + 8)
    model = load_model(directory, progress=False)
    assert isinstance(model, DeepseekV41) and len(model.mtp) == 2
    assert model.layers[1].engram.embed.weight.dtype == torch.float8_e4m3fn
    logits = model(PackedBatch.from_sequences([[0, 5, 17, 99, 3]]))
    assert logits.shape == (5, 512) and torch.isfinite(logits).all()


def test_loaded_weights_are_the_dequantised_stored_ones(tiny_v41_checkpoint):
    model = load_model(tiny_v41_checkpoint, progress=False)
    stored = _stored(tiny_v41_checkpoint)
    table = model.layers[6].engram.embed
    weight_map = json.loads((tiny_v41_checkpoint / INDEX_FILE).read_text())["weight_map"]
    with safe_open(tiny_v41_checkpoint / weight_map["layers.6.attn.wo_a.weight"], "pt") as handle:
        fp8 = handle.get_tensor("layers.6.attn.wo_a.weight").float()
    with safe_open(tiny_v41_checkpoint / weight_map["layers.6.attn.wo_a.scale"], "pt") as handle:
        scale = handle.get_tensor("layers.6.attn.wo_a.scale").float()
    expected = fp8 * scale.repeat_interleave(32, 0).repeat_interleave(32, 1)[: fp8.shape[0], : fp8.shape[1]]
    assert torch.equal(model.layers[6].attn.wo_a.weight, expected)
    rows = torch.tensor([0, 7, table.weight.shape[0] - 1])
    assert torch.equal(table(rows), table.weight[rows].float() * table.scale[rows].repeat_interleave(32, -1))
    assert stored["layers.6.engram.embed.scale"][1] == tuple(table.scale.shape)


def test_hugging_face_names_load_to_the_same_model(checkpoint, tiny_v41_checkpoint):
    """HF's V4.1 modules keep the official names under ``model.``; the head is ``lm_head``."""
    weight_map = json.loads((checkpoint / INDEX_FILE).read_text())["weight_map"]
    renamed_map = {}
    for shard in sorted(set(weight_map.values())):
        tensors = load_file(checkpoint / shard)
        renamed = {("lm_head.weight" if k == "head.weight" else "model." + k): v for k, v in tensors.items()}
        save_file(renamed, str(checkpoint / shard))
        renamed_map.update(dict.fromkeys(renamed, shard))
    (checkpoint / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": renamed_map}))
    tokens = [[0, 9, 44, 120, 7, 7, 300]]
    ours = load_model(checkpoint, progress=False)(PackedBatch.from_sequences(tokens))
    official = load_model(tiny_v41_checkpoint, progress=False)(PackedBatch.from_sequences(tokens))
    assert torch.equal(ours, official)


def test_bfloat16_and_unquantized_checkpoints_run(tmp_path, tiny_v41_checkpoint):
    tokens = [[0, 9, 44, 120, 7, 7, 300, 11]]
    fp32 = load_model(tiny_v41_checkpoint, progress=False)(PackedBatch.from_sequences(tokens))
    bf16 = load_model(tiny_v41_checkpoint, dtype=torch.bfloat16, progress=False)(PackedBatch.from_sequences(tokens))
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()
    assert (bf16 - fp32).abs().max() < 0.25 * fp32.abs().max()
    assert main(["make-tiny", str(tmp_path / "plain"), "--arch", "v41", "--no-quant"]) == 0
    plain = load_model(tmp_path / "plain", progress=False)
    assert plain.layers[1].engram.embed.weight.dtype == torch.float32
    assert torch.isfinite(plain(PackedBatch.from_sequences(tokens))).all()


def test_missing_engram_tensor_is_named(checkpoint):
    name = "layers.1.engram.embed.scale"
    _rewrite_shard(checkpoint, name, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) 'layers\.1\.engram\.embed\.scale'"):
        load_model(checkpoint, progress=False)


def test_wrongly_sized_engram_table_is_named(checkpoint):
    name = "layers.6.engram.embed.weight"
    _rewrite_shard(checkpoint, name, lambda t: t.update({name: t[name][:-1].contiguous()}))
    with pytest.raises(
        CheckpointError, match=r"tensor 'layers\.6\.engram\.embed\.weight': shape \(\d+, 32\), expected"
    ):
        load_model(checkpoint, progress=False)


def test_optional_dspark_vision_bias_defaults_to_zero(checkpoint):
    name = "mtp.0.ffn.gate.bias_vl"
    _rewrite_shard(checkpoint, name, lambda t: t.pop(name))
    model = load_model(checkpoint, progress=False)
    assert torch.equal(model.mtp[0].ffn.gate.bias_vl, torch.zeros(4))


def test_tokenizer_that_does_not_belong_to_the_checkpoint(checkpoint):
    raw = json.loads((checkpoint / "config.json").read_text())
    raw["text_config"]["engram_compressed_vocab_size"] += 1
    (checkpoint / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: the tokenizer yields \d+ compressed Engram ids"):
        load_model(checkpoint, progress=False)
    (checkpoint / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"the Engram layers need the checkpoint's tokenizer"):
        load_model(checkpoint, progress=False)


def test_cache_accounting(tiny_v41_checkpoint):
    from dsinfer.kv.cache_v41 import KVCacheV41

    model = load_model(tiny_v41_checkpoint, progress=False)
    cfg = model.config
    cache = KVCacheV41(cfg, 2, 5, 16, torch.float32, "cpu", with_dspark=True)
    stored = sum(layer.window.numel() * 4 for layer in cache.layers)
    for layer in cache.layers:
        if layer.source is not None:
            for t in (
                layer.source.pending_values,
                layer.source.pending_gates,
                layer.source.entries,
                layer.source.index_keys,
            ):
                stored += 0 if t is None else t.numel() * t.element_size()
    stored += cache.engram_history.numel() * 8 + sum(r.numel() * 4 for r in cache.dspark_rings)
    assert stored == 2 * cache.slot_bytes() + (5 + cache.spare_blocks) * cache.block_bytes()  # + the trash block
    # per token: ratio-2 sources store half an entry and half a key, the ratio-1 source a whole one
    assert math.isclose(cache.bytes_per_token(), (2 * 0.5 + 1) * (cfg.head_dim + cfg.index_head_dim) * 4)
