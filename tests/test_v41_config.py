"""DeepSeek-V4.1 configs: every spelling parses to one validated object; impossible values name the field."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dsinfer.config import ConfigError, ModelConfig, ModelConfigV41
from dsinfer.config.vision import VisionConfig

# The released layout (abridged): a composite object with the text fields under text_config.
HUB_CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "image_token_id": 129264,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]},
    "vision_config": {"hidden_size": 1024, "num_hidden_layers": 32},
    "text_config": {
        "model_type": "deepseek_v41_text",
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20],
        "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20,
        "engram_layer_ids": [1, 14],
        "engram_num_embeddings": [384006168, 384016682],
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 65536,
        },
        "rms_norm_eps": 1e-20,
        "eos_token_id": 1,
    },
}

# DeepSeek's inference-code spelling of the same model.
INFERENCE_CONFIG = {
    "dim": 5120,
    "n_layers": 40,
    "n_heads": 64,
    "moe_inter_dim": 2304,
    "n_activated_experts": 6,
    "route_scale": 1.5,
    "score_func": "sqrtsoftplus",
    "window_size": 128,
    "norm_eps": 1e-20,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layers": [2, 8, 14, 20],
    "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer": 20,
    "engram_layer_ids": [1, 14],
    "n_mtp_layers": 3,
    "dspark_n_activated_experts": 3,
    "rope_factor": 16,
    "original_seq_len": 65536,
    "beta_fast": 32,
    "beta_slow": 1,
    "max_seq_len": 1048576,
    "quantization_config": {"weight_block_size": [32, 32]},
}


def test_released_config_parses_with_the_released_roles():
    cfg = ModelConfig.from_dict(HUB_CONFIG)
    assert isinstance(cfg, ModelConfigV41)
    assert cfg.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20  # the 3 DSpark entries are dropped
    assert cfg.kv_source_of(7) == 2 and cfg.kv_source_of(27) == 20 and cfg.index_source_of(27) == 24
    assert cfg.kv_source_of(1) is None and cfg.decoder_start == 20 and cfg.uses_candidates(24)
    assert not cfg.uses_candidates(20) and not cfg.uses_candidates(14)
    assert cfg.engram_num_embeddings == (384006168, 384016682)
    assert cfg.dspark_target_layer_ids == (37, 38, 39)
    assert cfg.quantization.weight_block_size == (32, 32)
    assert cfg.rms_norm_eps == 1e-20 and cfg.image_token_id == 129264


def test_defaults_are_the_released_model():
    # As in Hugging Face's DeepseekV41TextConfig, Engram is off unless the config names its layers.
    assert ModelConfigV41().engram_layer_ids == ()
    cfg = ModelConfigV41(engram_layer_ids=(1, 14))
    hub = ModelConfig.from_dict({**HUB_CONFIG, "quantization_config": None})
    assert cfg == replace(hub, vision=None)
    assert hub.vision == VisionConfig(hidden_size=1024, num_hidden_layers=32)  # the hub's vision_config, parsed


def test_inference_spelling_parses_to_the_same_model():
    ours = ModelConfig.from_dict(INFERENCE_CONFIG)
    hub = ModelConfig.from_dict(HUB_CONFIG)
    assert ours == replace(hub, vision=None)  # the inference spelling here carries no vision tower


def test_round_trip_through_to_dict():
    cfg = ModelConfig.from_dict(HUB_CONFIG)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    flat = {**cfg.to_dict()["text_config"], "image_token_id": cfg.image_token_id}
    composite = ModelConfigV41.from_dict({**cfg.to_dict(), "quantization_config": None})
    assert ModelConfigV41.from_dict(flat) == replace(composite, vision=None)  # a flat text config has no tower
    assert composite.vision == cfg.vision is not None


def test_custom_schedule_without_sources_picks_the_first_layer_of_each_run():
    cfg = ModelConfigV41.from_dict(
        {"model_type": "deepseek_v41_text", "num_hidden_layers": 7, "compress_ratios": [0, 2, 2, 1, 1, 1, 1]}
    )
    assert cfg.kv_source_layer_ids == (1, 3) == cfg.index_source_layer_ids
    assert cfg.candidate_source_layer_id == 3 and cfg.dspark_target_layer_ids == (4, 5, 6)
    disabled = ModelConfigV41.from_dict(
        {**cfg.to_dict(), "text_config": {**cfg.to_dict()["text_config"], "candidate_source_layer_id": -5}}
    )
    assert disabled.candidate_source_layer_id == -1 and not disabled.uses_candidates(6)


def _text(**change):
    return {**HUB_CONFIG, "text_config": {**HUB_CONFIG["text_config"], **change}}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (_text(kv_source_layer_ids=[1, 8, 14, 20]), r"field 'kv_source_layer_ids': layer 1 has compress ratio 0"),
        (_text(kv_source_layer_ids=[2, 14, 8, 20]), r"field 'kv_source_layer_ids': expected increasing"),
        (
            _text(kv_source_layer_ids=[2, 8, 14]),
            r"field 'compress_ratios': layer 20 \(ratio 1\) would reuse KV source 14",
        ),
        (_text(index_source_layer_ids=[2, 8, 20, 24]), r"KV source layer 14 must also be an index source"),
        (_text(candidate_source_layer_id=21), r"field 'candidate_source_layer_id': layer 21 is not an index source"),
        (_text(candidate_source_layer_id=14), r"field 'kv_source_layer_ids': KV source 20 comes after the candidate"),
        (_text(compress_ratios=[0, 0, 2]), r"field 'compress_ratios': 3 entries for 40 layers"),
        (_text(compress_ratios=[0, 0] + [2] * 17 + [-1] + [1] * 20), r"field 'compress_ratios': layer 19 has ratio -1"),
        (_text(engram_num_embeddings=[384006168, 5]), r"field 'engram_num_embeddings'"),
        (_text(engram_layer_ids=[1, 40]), r"field 'engram_layer_ids'"),
        (_text(engram_head_dim=250), r"field 'engram_head_dim': 250 is not a multiple of 32"),
        (_text(num_key_value_heads=8), r"field 'num_key_value_heads': DeepSeek-V4\.1 uses 1"),
        (_text(rms_norm_eps=0), r"field 'rms_norm_eps': must lie in \(0, 1\)"),
        (_text(hidden_size="5120"), r"field 'hidden_size': expected a number"),
        (_text(dspark_num_experts_per_tok=200), r"field 'dspark_num_experts_per_tok': 200 exceeds"),
        (_text(dspark_target_layer_ids=[38, 39, 40]), r"field 'dspark_target_layer_ids': layer 40"),
        (_text(scoring_func="softmax"), r"field 'scoring_func'"),
        (_text(model_type="llama"), r"field 'text_config.model_type'"),
        ({**HUB_CONFIG, "text_config": [1, 2]}, r"field 'text_config': expected an object"),
        ({**HUB_CONFIG, "image_token_id": 200000}, r"field 'image_token_id': 200000 is outside the vocabulary"),
        (
            {**HUB_CONFIG, "quantization_config": {"weight_block_size": [32]}},
            r"field 'quantization_config.weight_block_size'",
        ),
    ],
)
def test_impossible_values_name_the_field(config, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(config)


def test_config_file_dispatches_on_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HUB_CONFIG))
    assert isinstance(ModelConfig.from_file(tmp_path), ModelConfigV41)
    (tmp_path / "config.json").write_text(json.dumps(_text(o_groups=7)))
    with pytest.raises(ConfigError, match=r"config\.json: field 'o_groups'"):
        ModelConfig.from_file(tmp_path)


def test_bad_vision_config_names_the_field():
    with pytest.raises(ConfigError, match="vision_config.num_attention_heads"):
        ModelConfig.from_dict({**HUB_CONFIG, "vision_config": {"hidden_size": 1024, "num_attention_heads": 7}})
    with pytest.raises(ConfigError, match="vision_config.patch_size"):
        ModelConfig.from_dict({**HUB_CONFIG, "vision_config": {"patch_size": 0}})
    with pytest.raises(ConfigError, match="field 'vision_config': expected an object"):
        ModelConfig.from_dict({**HUB_CONFIG, "vision_config": [1]})
