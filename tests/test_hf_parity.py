"""Parity of our V4 forward with the Hugging Face reference ``DeepseekV4ForCausalLM`` (fp32 logits)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dsinfer.kv.batch import PackedBatch
from dsinfer.models.expert_packing import dequantized_state_dict
from dsinfer.models.hf_names import official_to_hf_state_dict
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import quantize_like_checkpoint, write_checkpoint

LAYER_TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
]


def _hf_model(seed: int, hca_rate: int, window: int) -> DeepseekV4ForCausalLM:
    """A tiny random HF model whose weights are large enough that every branch moves the logits."""
    config = DeepseekV4Config(
        vocab_size=96,
        hidden_size=64,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4,
        head_dim=64,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        sliding_window=window,
        layer_types=LAYER_TYPES,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca_rate},
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
        index_n_heads=16,
        index_head_dim=32,
        index_topk=4,
        partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64},
    )
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif param.dim() >= 2:
                param.normal_(0, param.shape[-1] ** -0.5)
            else:
                param.normal_(0, 0.5)
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                gate.tid2eid.copy_(torch.rand(config.vocab_size, 8).argsort(-1)[:, :2])
            else:
                gate.e_score_correction_bias.normal_(0, 0.5)
    return model


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    """HF model (window 8, HCA every 16) saved with save_pretrained, then loaded by dsinfer."""
    hf = _hf_model(seed=1, hca_rate=16, window=8)
    directory = tmp_path_factory.mktemp("hf-v4")
    hf.save_pretrained(directory)
    return hf, load_model(directory, progress=False)


@pytest.mark.parametrize("length", [1, 3, 9, 31, 64, 97])
def test_logits_match_hugging_face(hf_and_ours, length):
    hf, ours = hf_and_ours
    ids = torch.randint(0, 96, (length,), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = ours(PackedBatch.from_sequences([ids.tolist()]))
    assert _relative_error(got, ref) < 1e-4


def test_packed_batch_equals_each_sequence_alone(hf_and_ours):
    hf, ours = hf_and_ours
    gen = torch.Generator().manual_seed(7)
    sequences = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (40, 5, 70, 17)]
    got = ours(PackedBatch.from_sequences(sequences))
    start = 0
    for seq in sequences:
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0]
        assert _relative_error(got[start : start + len(seq)], ref) < 1e-4
        start += len(seq)


def test_every_branch_matters(hf_and_ours):
    """The parity above would not hold with a branch switched off: the test data exercises all of them."""
    hf, ours = hf_and_ours
    ids = torch.randint(0, 96, (97,), generator=torch.Generator().manual_seed(3))
    batch = PackedBatch.from_sequences([ids.tolist()])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        for layer_id in (1, 2):  # one CSA, one HCA layer: drop its compressed entries
            compressor = ours.layers[layer_id].attn.compressor
            ours.layers[layer_id].attn.compressor = None
            assert _relative_error(ours(batch), ref) > 1e-3
            ours.layers[layer_id].attn.compressor = compressor
        indexer = ours.layers[1].attn.indexer
        indexer.topk, saved = 10_000, indexer.topk  # attend to every entry instead of the top-k
        assert _relative_error(ours(batch), ref) > 1e-3
        indexer.topk = saved


def test_real_compression_ratios_and_window(tmp_path):
    """The V4-Flash spans (window 128, HCA 128) over prompts that cross several 128-token boundaries."""
    hf = _hf_model(seed=2, hca_rate=128, window=128)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, progress=False)
    for length in (129, 300):
        ids = torch.randint(0, 96, (length,), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            ref = hf(ids[None]).logits[0]
        assert _relative_error(ours(PackedBatch.from_sequences([ids.tolist()])), ref) < 1e-4


def test_hugging_face_module_names_with_fused_experts(tmp_path, hf_and_ours):
    """A checkpoint in HF's in-memory names (``self_attn.q_a_proj``, stacked experts) loads the same."""
    hf, ours = hf_and_ours
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(hf.config.to_json_string())
    reloaded = load_model(tmp_path, progress=False)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def test_fp8_fp4_checkpoint_matches_reference_on_dequantized_weights(tmp_path, hf_and_ours):
    """Quantise to the official FP8 (128x128 ue8m0) / FP4 (e2m1, per-32) formats, load, compare with HF
    running on the dequantised weights."""
    hf, ours = hf_and_ours
    config = ours.config.__class__.from_dict(
        {
            **ours.config.to_dict(),
            "quantization_config": {"weight_block_size": [128, 128], "expert_dtype": "fp4"},
        }
    )
    ours.config, original_config = config, ours.config
    try:
        stored = quantize_like_checkpoint(ours)
    finally:
        ours.config = original_config
    assert stored["layers.2.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.2.ffn.experts.3.w1.weight"].dtype == torch.int8
    write_checkpoint(stored, config, tmp_path, num_shards=2)
    quantized = load_model(tmp_path, progress=False)
    original = dequantized_state_dict(ours)["layers.2.ffn.experts.3.w1.weight"]
    assert not torch.equal(dequantized_state_dict(quantized)["layers.2.ffn.experts.3.w1.weight"], original)

    reference = DeepseekV4ForCausalLM(hf.config).eval()
    reference.load_state_dict(official_to_hf_state_dict(dequantized_state_dict(quantized)), strict=True)
    for length in (5, 64, 97):
        ids = torch.randint(0, 96, (length,), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            ref = reference(ids[None]).logits[0]
        assert _relative_error(quantized(PackedBatch.from_sequences([ids.tolist()])), ref) < 1e-4


def test_bfloat16_error_no_worse_than_hugging_face_bfloat16(tmp_path, hf_and_ours):
    """In bf16 both implementations drift from the fp32 reference; ours must not drift more."""
    hf, _ = hf_and_ours
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype=torch.bfloat16, progress=False)
    hf_bf16 = DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 96, (97,), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        hf_error = _relative_error(hf_bf16(ids[None]).logits[0].float(), ref)
    our_error = _relative_error(ours(PackedBatch.from_sequences([ids.tolist()])), ref)
    assert our_error <= 1.25 * hf_error
