"""One DeepSeek-V4 transformer block on ``hc_mult`` residual streams: an attention site and an MoE site."""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.config import ModelConfig
from dsinfer.kv.batch import PackedBatch
from dsinfer.layers.attention import Attention
from dsinfer.layers.mhc import collapse_streams, expand_streams, hyper_connection_weights
from dsinfer.layers.moe import MoE
from dsinfer.layers.norm import RMSNorm
from dsinfer.ops.registry import OpTable


def hc_parameters(config: ModelConfig) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
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
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = hc_parameters(config)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = hc_parameters(config)
        self.ops: OpTable | None = None  # bound by the model (bind_ops); None: the torch references

    def forward(
        self, streams: torch.Tensor, batch: PackedBatch, inv_freq: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        cfg = self.config
        pre, post, comb = hyper_connection_weights(
            streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
            cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, self.ops,
        )  # fmt: skip
        attn_out = self.attn(self.attn_norm(collapse_streams(streams, pre)), batch, inv_freq, self.layer_id)
        streams = expand_streams(attn_out, streams, post, comb)
        pre, post, comb = hyper_connection_weights(
            streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale,
            cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, self.ops,
        )  # fmt: skip
        ffn_out = self.ffn(self.ffn_norm(collapse_streams(streams, pre)), input_ids)
        return expand_streams(ffn_out, streams, post, comb)
