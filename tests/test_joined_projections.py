"""Joined projections (``DeepseekModel.join_projections``): one GEMM for the shared expert's gate and up and for each
compressor's values and gates, with the parameters left as views of the stacked weight."""

from __future__ import annotations

from dataclasses import replace

import torch

from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v4 import KVCache, attention_layer_ratios, block_tokens_for
from dsinfer.models.tiny import build_random_model, tiny_config


def _decode_logits(model, steps: int = 6) -> torch.Tensor:
    """Greedy logits of a short prompt prefilled then decoded token by token (compressors' decode path)."""
    torch.manual_seed(0)
    config = model.config
    cache = KVCache(
        config, attention_layer_ratios(config, False), 2, 16, block_tokens_for(config), torch.float32, "cpu"
    )
    prompt = torch.randint(3, 200, (37,)).tolist()
    model(PackedBatch(torch.tensor(prompt), torch.arange(37), [SequenceSpan(0, 37, 0, list(range(8)))], cache))
    out = []
    for step in range(steps):
        position = 37 + step
        token = torch.tensor([(position * 7) % 200])
        decode = PackedBatch(token, torch.tensor([position]), [SequenceSpan(position, 1, 0, list(range(8)))], cache)
        out.append(model(decode))
    return torch.cat(out)


def test_joined_model_decodes_as_the_separate_projections_and_keeps_its_parameters():
    config = replace(tiny_config(), num_nextn_predict_layers=0)
    model = build_random_model(config, torch.float32, "cpu", seed=3)
    expected = _decode_logits(model)
    names = sorted(name for name, _ in model.named_parameters())
    model.join_projections()
    shared = model.layers[1].ffn.shared_experts
    compressor = model.layers[1].attn.compressor
    assert shared.joined_gate_up is not None and compressor.joined_projection is not None
    assert sorted(name for name, _ in model.named_parameters()) == names
    assert shared.w3.weight.data_ptr() == shared.joined_gate_up[shared.w1.weight.shape[0] :].data_ptr()
    got = _decode_logits(model)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # the stack follows in-place updates of the parameters (a state-dict load)
        shared.w1.weight.mul_(0)
    assert bool((shared.joined_gate_up[: shared.w1.weight.shape[0]] == 0).all())
