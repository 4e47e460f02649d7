"""DeepSeek-V4-Flash, top to bottom: embedding -> mHC blocks (attention, MoE) -> hc_head -> norm -> head.

Module and parameter names follow DeepSeek's official checkpoint naming (``embed``, ``layers.L.attn``,
``layers.L.ffn``, ``hc_head_fn``...), so a state dict of this module *is* an official checkpoint after
dequantisation. The forward takes a :class:`PackedBatch` of whole sequences.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.config import ModelConfig
from dsinfer.layers.attention import Attention
from dsinfer.layers.mhc import collapse_streams, expand_streams, hyper_connection_weights, hyper_head
from dsinfer.layers.moe import MoE
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.rotary import rope_inverse_frequencies
from dsinfer.models.batch import PackedBatch


def _hc_parameters(config: ModelConfig) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """(fn, base, scale) of one hyper-connection site: pre (n), post (n) and comb (n * n) weights."""
    n = config.hc_mult
    width = (2 + n) * n
    return (
        nn.Parameter(torch.zeros(width, n * config.hidden_size, dtype=torch.float32)),
        nn.Parameter(torch.zeros(width, dtype=torch.float32)),
        nn.Parameter(torch.ones(3, dtype=torch.float32)),
    )


class Block(nn.Module):
    """One transformer block on ``hc_mult`` residual streams: an attention site and an MoE site."""

    def __init__(self, config: ModelConfig, layer_id: int, compress_ratio: int, hash_routed: bool) -> None:
        super().__init__()
        self.config = config
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, compress_ratio)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = MoE(config, hash_routed)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = _hc_parameters(config)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = _hc_parameters(config)

    def forward(
        self, streams: torch.Tensor, batch: PackedBatch, inv_freq: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        cfg = self.config
        pre, post, comb = hyper_connection_weights(
            streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
            cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps,
        )  # fmt: skip
        attn_out = self.attn(self.attn_norm(collapse_streams(streams, pre)), batch, inv_freq)
        streams = expand_streams(attn_out, streams, post, comb)
        pre, post, comb = hyper_connection_weights(
            streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale,
            cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps,
        )  # fmt: skip
        ffn_out = self.ffn(self.ffn_norm(collapse_streams(streams, pre)), input_ids)
        return expand_streams(ffn_out, streams, post, comb)


class RopeTables(nn.Module):
    """Inverse RoPE frequencies: plain for window-only layers, YaRN-scaled for compressed ones."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dim = config.qk_rope_head_dim
        self.register_buffer("window", rope_inverse_frequencies(dim, config.rope_theta, None), persistent=False)
        self.register_buffer(
            "compressed",
            rope_inverse_frequencies(dim, config.compress_rope_theta, config.yarn),
            persistent=False,
        )

    def for_ratio(self, compress_ratio: int) -> torch.Tensor:
        return self.compressed if compress_ratio else self.window


class DeepseekV4(nn.Module):
    def __init__(self, config: ModelConfig, with_mtp: bool = True) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Block(config, i, config.compress_ratios[i], config.is_hash_layer(i))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        n = config.hc_mult
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * config.hidden_size, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.rope = RopeTables(config)
        self.mtp = nn.ModuleList()

    def hidden_streams(self, batch: PackedBatch) -> torch.Tensor:
        """Run the embedding and every block; returns the residual streams [T, hc_mult, hidden]."""
        embedded = self.embed(batch.input_ids)
        streams = embedded.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, batch, self.rope.for_ratio(layer.attn.compress_ratio), batch.input_ids)
        return streams

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        collapsed = hyper_head(
            streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg.hc_eps, cfg.rms_norm_eps
        )
        return self.norm(collapsed)

    def forward(self, batch: PackedBatch, logits_for: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, vocab] for every token, or only for the token indices in ``logits_for``."""
        hidden = self.final_hidden(self.hidden_streams(batch))
        if logits_for is not None:
            hidden = hidden[logits_for]
        return self.head(hidden).float()
