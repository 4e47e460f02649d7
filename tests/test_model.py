"""Properties of the V4 model on the tiny checkpoint: causality, dtypes, the MTP layer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsinfer.kv.batch import PackedBatch
from dsinfer.models.loader import INDEX_FILE, CheckpointError, load_model


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint, progress=False)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_logits_are_causal(model):
    """Changing a late token never moves an earlier position's logits (window, CSA, HCA and indexer)."""
    tokens = _tokens(90, 1)
    base = model(PackedBatch.from_sequences([tokens]))
    changed = tokens[:60] + [(t + 7) % 400 for t in tokens[60:]]
    after = model(PackedBatch.from_sequences([changed]))
    # Equal up to float reassociation (expert matmuls see a different set of rows).
    assert torch.allclose(base[:60], after[:60], rtol=1e-5, atol=1e-5)
    assert (base[60:] - after[60:]).abs().amax() > 1e-2


def test_bfloat16_tracks_float32(tiny_checkpoint, model):
    bf16 = load_model(tiny_checkpoint, dtype=torch.bfloat16, progress=False)
    assert bf16.layers[1].attn.wq_b.weight.dtype == torch.bfloat16
    assert bf16.layers[1].hc_attn_fn.dtype == torch.float32  # mHC stays fp32
    batch = PackedBatch.from_sequences([_tokens(70, 2), _tokens(9, 3)])
    ref, got = model(batch), bf16(batch)
    # Random tiny weights amplify rounding; the HF comparison in test_hf_parity bounds bf16 more tightly.
    assert ((got - ref).norm() / ref.norm()).item() < 8e-2
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.85


def test_last_token_logits_only(model):
    batch = PackedBatch.from_sequences([_tokens(20, 4), _tokens(33, 5)])
    full = model(batch)
    last = model(batch, logits_for=batch.last_token_indices())
    assert torch.allclose(last, full[[19, 52]], atol=1e-5, rtol=1e-5)


def test_mtp_layer_is_loaded_and_causal(model, tiny_checkpoint):
    stored = {}
    for shard in sorted(tiny_checkpoint.glob("*.safetensors")):
        stored.update(load_file(shard))
    assert "mtp.0.e_proj.scale" in stored and stored["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    assert not torch.equal(model.mtp[0].e_proj.weight, torch.zeros_like(model.mtp[0].e_proj.weight))

    tokens = _tokens(50, 6)
    batch = PackedBatch.from_sequences([tokens[:-1]])
    next_ids = torch.tensor(tokens[1:])
    draft = model.mtp_logits(model.hidden_streams(batch), batch, next_ids)
    assert draft.shape == (49, model.config.vocab_size) and torch.isfinite(draft).all()
    # The draft at position i sees target states <= i and the token i + 1, nothing later.
    changed = tokens[:30] + [(t + 11) % 400 for t in tokens[30:]]
    batch2 = PackedBatch.from_sequences([changed[:-1]])
    draft2 = model.mtp_logits(model.hidden_streams(batch2), batch2, torch.tensor(changed[1:]))
    assert torch.allclose(draft[:29], draft2[:29], rtol=1e-5, atol=1e-5)
    assert (draft[29:] - draft2[29:]).abs().amax() > 1e-2


def test_checkpoint_without_mtp_loads_without_it(tiny_checkpoint, tmp_path):
    target = tmp_path / "no-mtp"
    shutil.copytree(tiny_checkpoint, target)
    index = json.loads((target / INDEX_FILE).read_text())
    for shard in sorted(target.glob("*.safetensors")):
        tensors = {k: v for k, v in load_file(shard).items() if not k.startswith("mtp.")}
        save_file(tensors, str(shard))
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    (target / INDEX_FILE).write_text(json.dumps(index))
    model = load_model(target, progress=False)
    assert len(model.mtp) == 0
    batch = PackedBatch.from_sequences([[5, 6, 7]])
    with pytest.raises(RuntimeError, match="no MTP layer"):
        model.mtp_logits(model.hidden_streams(batch), batch, torch.tensor([6, 7, 8]))


def test_partial_mtp_is_a_missing_tensor_error(tiny_checkpoint, tmp_path):
    target = tmp_path / "half-mtp"
    shutil.copytree(tiny_checkpoint, target)
    index = json.loads((target / INDEX_FILE).read_text())
    shard = target / index["weight_map"]["mtp.0.enorm.weight"]
    tensors = load_file(shard)
    tensors.pop("mtp.0.enorm.weight")
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) 'mtp\.0\.enorm\.weight'"):
        load_model(target, progress=False)
