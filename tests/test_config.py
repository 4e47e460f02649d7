"""config.json parsing: official, inference-code and Hugging Face spellings; clear errors for bad values."""

from __future__ import annotations

import json

import pytest
from transformers import DeepseekV4Config

from dsinfer.config import ConfigError, ModelConfig

# The keys of DeepSeek-V4-Flash's published config.json (values as released).
HUB_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "expert_dtype": "fp4",
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 512,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 512,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 43,
    "num_hash_layers": 3,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 129280,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
}

# The same model in the reference inference code's ModelArgs spelling.
INFERENCE_CONFIG = {
    "vocab_size": 129280,
    "dim": 4096,
    "moe_inter_dim": 2048,
    "n_layers": 43,
    "n_hash_layers": 3,
    "n_heads": 64,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "n_activated_experts": 6,
    "score_func": "sqrtsoftplus",
    "route_scale": 1.5,
    "swiglu_limit": 10.0,
    "q_lora_rank": 1024,
    "head_dim": 512,
    "rope_head_dim": 64,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "window_size": 128,
    "original_seq_len": 65536,
    "rope_theta": 10000,
    "rope_factor": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "dtype": "fp8",
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
    "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}


def test_hub_config_parses_to_v4_flash():
    cfg = ModelConfig.from_dict(HUB_CONFIG)
    assert cfg.hidden_size == 4096 and cfg.num_hidden_layers == 43
    assert cfg.compress_ratios[:4] == (0, 0, 4, 128) and len(cfg.compress_ratios) == 43
    assert [cfg.layer_kind(i) for i in (0, 2, 3)] == ["window", "csa", "hca"]
    assert cfg.num_hash_layers == 3 and cfg.is_hash_layer(2) and not cfg.is_hash_layer(3)
    assert cfg.yarn is not None and cfg.yarn.factor == 16 and cfg.yarn.original_max_position_embeddings == 65536
    assert cfg.quantization is not None and cfg.quantization.weight_block_size == (128, 128)
    assert cfg.quantization.expert_dtype == "fp4"


def test_inference_spelling_gives_the_same_config():
    hub = ModelConfig.from_dict(HUB_CONFIG)
    inference = ModelConfig.from_dict(INFERENCE_CONFIG)
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
                  "num_experts_per_tok", "routed_scaling_factor", "sliding_window", "qk_rope_head_dim",
                  "num_hash_layers", "compress_ratios", "yarn", "compress_rope_theta"):  # fmt: skip
        assert getattr(inference, field) == getattr(hub, field), field


def test_hugging_face_config_gives_the_same_config():
    hf = DeepseekV4Config(
        layer_types=[
            {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}[r]
            for r in HUB_CONFIG["compress_ratios"][:43]
        ],
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536},
    )
    ours = ModelConfig.from_dict(json.loads(hf.to_json_string()))
    hub = ModelConfig.from_dict({**HUB_CONFIG, "quantization_config": None})
    assert ours == hub


def test_round_trip_through_to_dict():
    cfg = ModelConfig.from_dict(HUB_CONFIG)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"model_type": "llama"},
            r"field 'model_type': expected one of \['deepseek_v4', 'deepseek_v41', .*got 'llama'",
        ),
        ({"hidden_size": -4096}, r"field 'hidden_size': must be positive"),
        ({"hidden_size": "4096"}, r"field 'hidden_size': expected a number"),
        ({"num_hidden_layers": 4.5}, r"field 'num_hidden_layers': expected an integer"),
        ({"num_experts_per_tok": 300}, r"field 'num_experts_per_tok': 300 exceeds n_routed_experts \(256\)"),
        ({"compress_ratios": [0, 0, 4]}, r"field 'compress_ratios': 3 entries for 43 layers"),
        ({"compress_ratios": [0, 0, 5] + [4] * 41}, r"field 'compress_ratios': layer 2 has ratio 5"),
        ({"qk_rope_head_dim": 63}, r"field 'qk_rope_head_dim': must be even"),
        ({"o_groups": 7}, r"field 'o_groups': 7 does not divide num_attention_heads"),
        ({"scoring_func": "softmax"}, r"field 'scoring_func'"),
        ({"rms_norm_eps": 0}, r"field 'rms_norm_eps': must lie in \(0, 1\)"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, r"field 'rope_scaling.type'"),
        ({"quantization_config": {"weight_block_size": [128]}}, r"field 'quantization_config.weight_block_size'"),
        ({"expert_dtype": "int3"}, r"field 'quantization_config.expert_dtype'"),
        ({"layer_types": ["full_attention"] * 43}, r"field 'layer_types': unknown entries"),
        ({"mlp_layer_types": ["moe", "hash_moe"] + ["moe"] * 41}, r"field 'mlp_layer_types'"),
        ({"eos_token_id": 200000}, r"field 'eos_token_id'"),
    ],
)
def test_impossible_values_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**HUB_CONFIG, **change})


def test_config_file_errors_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        ModelConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**HUB_CONFIG, "hidden_size": 0}))
    with pytest.raises(ConfigError, match=r"config\.json: field 'hidden_size'"):
        ModelConfig.from_file(tmp_path)


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        (
            {"rope_parameters": {"main": {"rope_type": "yarn", "factor": 4.0}, "compress": {"rope_type": "default"}}},
            "rope_parameters.main",
        ),
    ],
)
def test_math_changing_fields_we_do_not_compute_are_refused(fields, named):
    """A Hugging Face V4 config whose math we would not follow is one clear error naming the field."""
    hf = DeepseekV4Config(**fields).to_dict()
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        ModelConfig.from_dict(hf)


def test_hugging_face_defaults_for_those_fields_are_accepted():
    ModelConfig.from_dict(DeepseekV4Config(norm_topk_prob=True, hidden_act="silu").to_dict())
