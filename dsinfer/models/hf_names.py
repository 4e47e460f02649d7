"""Tensor names: DeepSeek's official spelling <-> the Hugging Face ``DeepseekV4ForCausalLM`` spelling.

The model uses official names. Hugging Face checkpoints come in two forms: the in-memory module names
(``model.layers.0.self_attn.q_a_proj.weight``, fused ``experts.gate_up_proj``) and what
``save_pretrained`` writes (mostly official names under a ``model.`` prefix, with a few leftovers such as
``embed_tokens`` and ``attn.norm`` for the main KV norm). We compare names in the Hugging Face module
space: ``to_hf_name`` follows the documented official -> HF renames and is idempotent on HF names, so any
spelling of a tensor lands on one key.
"""

from __future__ import annotations

import re

# Official -> Hugging Face renames, in the order the Hugging Face conversion map applies them.
_RENAMES: tuple[tuple[str, str], ...] = (
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"),
    (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"),
    (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)
_COMPILED = tuple((re.compile(pattern), target) for pattern, target in _RENAMES)
# Hugging Face stores the routed experts of a layer as two stacked tensors.
FUSED_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def strip_model_prefix(name: str) -> str:
    return name[len("model.") :] if name.startswith("model.") else name


def to_hf_name(name: str) -> str:
    """Hugging Face module name of a tensor given in either spelling (without the ``model.`` prefix)."""
    name = strip_model_prefix(name)
    if name.startswith("mtp."):
        return name  # Hugging Face does not model the MTP layer; its tensors keep official names
    for pattern, target in _COMPILED:
        name = pattern.sub(target, name)
    return name


def v41_name(name: str) -> str:
    """The one key of a V4.1 tensor: Hugging Face's V4.1 modules keep the official names, under ``model.``,
    except the output head (``lm_head``)."""
    name = strip_model_prefix(name)
    return "head.weight" if name == "lm_head.weight" else name


def official_to_hf_state_dict(state: dict) -> dict:
    """Rename an official-named state dict for ``DeepseekV4ForCausalLM.load_state_dict`` (experts stacked)."""
    import torch

    out, experts = {}, {}
    for name, tensor in state.items():
        if name.startswith("mtp."):
            continue
        match = re.match(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$", name)
        if match:
            layer, expert, which = match.groups()
            experts.setdefault(int(layer), {}).setdefault(int(expert), {})[which] = tensor
            continue
        hf = to_hf_name(name)
        out[hf if hf.startswith("lm_head") else "model." + hf] = tensor
    for layer, by_expert in experts.items():
        ordered = [by_expert[e] for e in sorted(by_expert)]
        gate_up = torch.stack([torch.cat([w["w1"], w["w3"]], dim=0) for w in ordered])
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([w["w2"] for w in ordered])
    return out
