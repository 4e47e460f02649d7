"""The Engram layer of DeepSeek-V4.1: table rows in, a gated write into the residual streams out.

Row ids come from :class:`dsinfer.engram.hashing.EngramHasher` (computed once per forward for every
Engram layer). At each position the layer reads its ``(max_ngram_size - 1) * n_heads`` rows (24 x 256 in
the release), concatenates them and projects them with ``wkv`` into one key per residual stream plus one
value shared by the streams. Each stream gets the value scaled by a gate

    gate = sigmoid(signed_sqrt(sum(h * q_weight * k_weight * key) * rstd(h) * rstd(key) / sqrt(hidden)))

where ``rstd`` normalises each (token, stream) over the hidden axis separately and the signed square root
keeps the sign of the dot product with a magnitude floor of 1e-6 (Hugging Face ``DeepseekV41Engram``).
The layer runs before the block it belongs to, so that block's mHC weights already see its output.

The tables stay as stored (FP8 e4m3 rows with one ue8m0 scale per 32 channels, or plain floats with unit
scales) and rows are dequantised on lookup. They are plain tensors here; a later step moves them to
host memory.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.config_v41 import FP8_SCALE_BLOCK, ModelConfigV41

GATE_MAGNITUDE_FLOOR = 1e-6


class EngramTable(nn.Module):
    """One layer's n-gram table: ``weight`` [rows, dim] (FP8 or float) and ``scale`` [rows, dim / 32]."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(rows, dim))
        self.register_buffer("scale", torch.ones(rows, dim // FP8_SCALE_BLOCK, dtype=torch.float32))

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        """Dequantised rows [..., dim] in float32."""
        values = self.weight[row_ids].float()
        scales = self.scale[row_ids].float()
        return (values.unflatten(-1, (-1, FP8_SCALE_BLOCK)) * scales.unsqueeze(-1)).flatten(-2)


class Engram(nn.Module):
    def __init__(self, config: ModelConfigV41, layer_id: int) -> None:
        super().__init__()
        index = config.engram_layer_ids.index(layer_id)
        self.hidden_size, self.hc_mult, self.eps = config.hidden_size, config.hc_mult, config.rms_norm_eps
        self.embed = EngramTable(config.engram_num_embeddings[index], config.engram_head_dim)
        self.wkv = nn.Linear(
            config.engram_columns * config.engram_head_dim, config.hidden_size * (config.hc_mult + 1), bias=False
        )
        self.q_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size))
        self.k_weight = nn.Parameter(torch.ones(config.hc_mult, config.hidden_size))

    def forward(self, streams: torch.Tensor, row_ids: torch.Tensor, gate_mask: torch.Tensor | None) -> torch.Tensor:
        """streams [T, hc, hidden]; row_ids [T, columns]; ``gate_mask`` [T] False shuts the gate (image tokens)."""
        rows = self.embed(row_ids).flatten(-2).to(self.wkv.weight.dtype)
        key, value = self.wkv(rows).split([self.hc_mult * self.hidden_size, self.hidden_size], dim=-1)
        key = key.float().unflatten(-1, (self.hc_mult, self.hidden_size))
        h = streams.float()
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        weight = self.q_weight.float() * self.k_weight.float()  # the checkpoint keeps both; only the product matters
        dot = (h * weight * key).sum(-1) * rstd * self.hidden_size**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_MAGNITUDE_FLOOR).sqrt(), dot))
        if gate_mask is not None:
            gate = gate.masked_fill(~gate_mask.unsqueeze(-1), 0.0)
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
