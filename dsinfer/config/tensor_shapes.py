"""The tensors a model of a config holds, by official name, with their shapes and how they are stored: enough to
say what the weights of a release weigh before any of them is read.

The serving plan (:mod:`dsinfer.memory_plan`) sums these to place the weights on GPUs and in host memory. Each
tensor has a storage class, the same for V4 and V4.1:

* ``fp8``: a linear the release stores as block-scaled FP8 (kept as codes and scales, or dequantised to the
  compute dtype on load, by the ``fp8_linears`` policy);
* ``float``: a weight kept in the compute dtype (embeddings, head, router, compressors, indexer projections);
* ``fp32``: small tensors the model keeps in float32 whatever the compute dtype (mHC, norms, sinks, biases);
* ``int32``: V4's hash-routing tables;
* ``fp4``: the routed experts, one entry per layer with shape ``[experts, 3, intermediate, hidden]`` (w1, w3,
  w2), packed two codes a byte with one ue8m0 scale per 32 inputs;
* ``engram``: a V4.1 Engram table, FP8 rows with one ue8m0 scale per 32 channels.

Routed experts of the drafters (MTP, DSpark) are listed as ``fp4`` too, under their own prefix. The test
``tests/test_memory_plan.py`` checks every name and element count against a model built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from dsinfer.config.model import ModelConfig, ModelConfigBase
from dsinfer.config.model_v41 import ModelConfigV41

STORAGES = ("fp8", "float", "fp32", "int32", "fp4", "engram")
ROUTED_EXPERTS = "ffn.experts"  # the name suffix of a layer's stacked routed experts


@dataclass(frozen=True)
class TensorShape:
    """One tensor (or one layer's stacked routed experts) of a model: its name, shape and storage class."""

    name: str
    shape: tuple[int, ...]
    storage: str

    @property
    def numel(self) -> int:
        return prod(self.shape)


def _hyper_connections(config: ModelConfigBase, prefix: str, sites: tuple[str, ...]) -> list[TensorShape]:
    mix, width = (2 + config.hc_mult) * config.hc_mult, config.hc_mult * config.hidden_size
    rows = []
    for site in sites:
        rows += [TensorShape(f"{prefix}hc_{site}_fn", (mix, width), "fp32"),
                 TensorShape(f"{prefix}hc_{site}_base", (mix,), "fp32"),
                 TensorShape(f"{prefix}hc_{site}_scale", (3,), "fp32")]  # fmt: skip
    return rows


def _attention(config: ModelConfigBase, prefix: str) -> list[TensorShape]:
    """Queries, the shared KV, sinks and the grouped output: the same in every layer of both families."""
    heads, head_dim, hidden, q_rank = (
        config.num_attention_heads,
        config.head_dim,
        config.hidden_size,
        config.q_lora_rank,
    )
    group_width = config.o_groups * config.o_lora_rank
    return [
        TensorShape(f"{prefix}attn_norm.weight", (hidden,), "fp32"),
        TensorShape(f"{prefix}attn.attn_sink", (heads,), "fp32"),
        TensorShape(f"{prefix}attn.wq_a.weight", (q_rank, hidden), "fp8"),
        TensorShape(f"{prefix}attn.q_norm.weight", (q_rank,), "fp32"),
        TensorShape(f"{prefix}attn.wq_b.weight", (heads * head_dim, q_rank), "fp8"),
        TensorShape(f"{prefix}attn.wkv.weight", (head_dim, hidden), "fp8"),
        TensorShape(f"{prefix}attn.kv_norm.weight", (head_dim,), "fp32"),
        TensorShape(f"{prefix}attn.wo_a.weight", (group_width, heads * head_dim // config.o_groups), "fp8"),
        TensorShape(f"{prefix}attn.wo_b.weight", (hidden, group_width), "fp8"),
    ]


def _moe(config: ModelConfigBase, prefix: str, experts: int, hash_routed: bool, image_bias: bool) -> list[TensorShape]:
    """Router, shared expert and the stacked routed experts of one layer."""
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    shared = inter * config.n_shared_experts
    rows = [TensorShape(f"{prefix}ffn_norm.weight", (hidden,), "fp32"),
            TensorShape(f"{prefix}ffn.gate.weight", (experts, hidden), "float")]  # fmt: skip
    if hash_routed:
        rows.append(TensorShape(f"{prefix}ffn.gate.tid2eid", (config.vocab_size, config.num_experts_per_tok), "int32"))
    else:
        rows.append(TensorShape(f"{prefix}ffn.gate.bias", (experts,), "fp32"))
    if image_bias:
        rows.append(TensorShape(f"{prefix}ffn.gate.bias_vl", (experts,), "fp32"))
    if shared:
        shapes = (("w1", (shared, hidden)), ("w2", (hidden, shared)), ("w3", (shared, hidden)))
        rows += [TensorShape(f"{prefix}ffn.shared_experts.{w}.weight", shape, "fp8") for w, shape in shapes]
    rows.append(TensorShape(f"{prefix}{ROUTED_EXPERTS}", (experts, 3, inter, hidden), "fp4"))
    return rows


def _compressor(prefix: str, ratio: int, width: int, out: int, hidden: int, with_ape: bool) -> list[TensorShape]:
    rows = [TensorShape(f"{prefix}ape", (ratio, width), "fp32")] if with_ape else []
    rows.append(TensorShape(f"{prefix}wkv.weight", (width, hidden), "float"))
    if ratio > 1:
        rows.append(TensorShape(f"{prefix}wgate.weight", (width, hidden), "float"))
    return [*rows, TensorShape(f"{prefix}norm.weight", (out,), "fp32")]


def v4_layer_tensors(config: ModelConfig, prefix: str, ratio: int, hash_routed: bool) -> list[TensorShape]:
    """One V4 block: mHC, attention with its CSA / HCA compressor and CSA indexer, the MoE."""
    hidden, head_dim, index_dim = config.hidden_size, config.head_dim, config.index_head_dim
    rows = _hyper_connections(config, prefix, ("attn", "ffn")) + _attention(config, prefix)
    if ratio:
        overlap = 2 if ratio == config.csa_ratio else 1  # CSA pools overlapping windows: twice the width
        rows += _compressor(f"{prefix}attn.compressor.", ratio, overlap * head_dim, head_dim, hidden, True)
    if ratio == config.csa_ratio:
        heads = config.index_n_heads
        rows += [TensorShape(f"{prefix}attn.indexer.wq_b.weight", (heads * index_dim, config.q_lora_rank), "fp8"),
                 TensorShape(f"{prefix}attn.indexer.weights_proj.weight", (heads, hidden), "float")]  # fmt: skip
        rows += _compressor(f"{prefix}attn.indexer.compressor.", ratio, 2 * index_dim, index_dim, hidden, True)
    return rows + _moe(config, prefix, config.n_routed_experts, hash_routed, False)


def v41_layer_tensors(config: ModelConfigV41, layer_id: int) -> list[TensorShape]:
    """One V4.1 block: mHC, Engram where configured, attention with the layer role's compressor and indexer, MoE."""
    prefix, hidden, ratio = f"layers.{layer_id}.", config.hidden_size, config.compress_ratios[layer_id]
    rows = _hyper_connections(config, prefix, ("attn", "ffn"))
    if layer_id in config.engram_layer_ids:
        rows += engram_layer_tensors(config, layer_id)
    rows += _attention(config, prefix)
    if config.is_kv_source(layer_id):
        rows += _compressor(f"{prefix}attn.compressor.", ratio, config.head_dim, config.head_dim, hidden, False)
    if config.is_index_source(layer_id):
        heads, index_dim = config.index_n_heads, config.index_head_dim
        rows += [TensorShape(f"{prefix}attn.indexer.wq_b.weight", (heads * index_dim, config.q_lora_rank), "fp8"),
                 TensorShape(f"{prefix}attn.indexer.weights_proj.weight", (heads, hidden), "float")]  # fmt: skip
        if config.is_kv_source(layer_id):  # keyed index sources project their own keys
            rows += [TensorShape(f"{prefix}attn.indexer.wk.weight", (index_dim, hidden), "float"),
                     TensorShape(f"{prefix}attn.indexer.k_norm.weight", (index_dim,), "fp32")]  # fmt: skip
    return rows + _moe(config, prefix, config.n_routed_experts, False, True)


def engram_layer_tensors(config: ModelConfigV41, layer_id: int) -> list[TensorShape]:
    """An Engram layer's gates, key/value projection and its table (the table is placed on its own)."""
    prefix, hidden = f"layers.{layer_id}.engram.", config.hidden_size
    rows_of_table = config.engram_num_embeddings[config.engram_layer_ids.index(layer_id)]
    reads = (config.engram_max_ngram_size - 1) * config.engram_n_heads * config.engram_head_dim
    return [
        TensorShape(f"{prefix}q_weight", (config.hc_mult, hidden), "float"),
        TensorShape(f"{prefix}k_weight", (config.hc_mult, hidden), "float"),
        TensorShape(f"{prefix}embed.weight", (rows_of_table, config.engram_head_dim), "engram"),
        TensorShape(f"{prefix}wkv.weight", ((config.hc_mult + 1) * hidden, reads), "fp8"),
    ]


def _ends(config: ModelConfigBase) -> list[TensorShape]:
    hidden, vocab = config.hidden_size, config.vocab_size
    return [TensorShape("embed.weight", (vocab, hidden), "float"), TensorShape("norm.weight", (hidden,), "fp32"),
            TensorShape("head.weight", (vocab, hidden), "float")]  # fmt: skip


def _hc_head(config: ModelConfigBase, prefix: str) -> list[TensorShape]:
    n = config.hc_mult
    return [
        TensorShape(f"{prefix}hc_head_fn", (n, n * config.hidden_size), "fp32"),
        TensorShape(f"{prefix}hc_head_base", (n,), "fp32"),
        TensorShape(f"{prefix}hc_head_scale", (1,), "fp32"),
    ]


def mtp_tensors(config: ModelConfig) -> list[TensorShape]:
    """V4's MTP layers: a window-only block plus its input projections, norms and hc_head."""
    hidden, rows = config.hidden_size, []
    for index in range(config.num_nextn_predict_layers):
        prefix = f"mtp.{index}."
        rows += v4_layer_tensors(config, prefix, 0, False) + _hc_head(config, prefix)
        rows += [TensorShape(f"{prefix}{name}.weight", (hidden,), "fp32") for name in ("enorm", "hnorm", "norm")]
        rows += [TensorShape(f"{prefix}{name}.weight", (hidden, hidden), "fp8") for name in ("e_proj", "h_proj")]
    return rows


def dspark_tensors(config: ModelConfigV41) -> list[TensorShape]:
    """V4.1's DSpark stages: window blocks with their own MoE; the first reads the target layers, the last
    holds the Markov and confidence heads."""
    hidden, stages, rows = config.hidden_size, config.num_nextn_predict_layers, []
    rank = config.dspark_markov_rank
    for stage in range(stages):
        prefix = f"mtp.{stage}."
        rows += _hyper_connections(config, prefix, ("attn", "ffn")) + _attention(config, prefix)
        rows += _moe(config, prefix, config.dspark_n_routed_experts, False, True)
        if stage == 0:
            targets = len(config.dspark_target_layer_ids)
            rows += [TensorShape(f"{prefix}main_proj.weight", (hidden, hidden * targets), "fp8"),
                     TensorShape(f"{prefix}main_norm.weight", (hidden,), "fp32")]  # fmt: skip
        if stage == stages - 1:
            rows += [TensorShape(f"{prefix}norm.weight", (hidden,), "fp32"),
                     TensorShape(f"{prefix}markov_head.embed.weight", (config.vocab_size, rank), "float"),
                     TensorShape(f"{prefix}markov_head.head.weight", (config.vocab_size, rank), "float"),
                     TensorShape(f"{prefix}confidence_head.proj.weight", (1, hidden + rank), "float")]  # fmt: skip
    return rows


def model_tensors(config: ModelConfig | ModelConfigV41, with_drafter: bool = False) -> list[TensorShape]:
    """Every tensor of the text model (no vision tower), the drafter's when ``with_drafter``."""
    if isinstance(config, ModelConfigV41):
        rows = _ends(config)
        for layer_id in range(config.num_hidden_layers):
            rows += v41_layer_tensors(config, layer_id)
        return rows + (dspark_tensors(config) if with_drafter else [])
    rows = _ends(config) + _hc_head(config, "")
    for layer_id, ratio in enumerate(config.compress_ratios):
        rows += v4_layer_tensors(config, f"layers.{layer_id}.", ratio, config.is_hash_layer(layer_id))
    return rows + (mtp_tensors(config) if with_drafter else [])
