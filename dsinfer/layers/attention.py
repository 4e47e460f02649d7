"""DeepSeek-V4 attention: shared-KV multi-query attention over a sliding window plus compressed entries.

One 512-d vector per token serves as both key and value. Every query sees the last ``sliding_window``
tokens of its sequence; CSA layers add the compressed entries the indexer selected, HCA layers all
visible compressed entries. A learned per-head sink joins the softmax denominator only. The output's
rope slice is rotated back, then a grouped low-rank projection (``wo_a`` per head group, ``wo_b``)
returns to the hidden size.

This is the reference path: exact, readable, quadratic in sequence length.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.config import ModelConfig
from dsinfer.layers.compressor import Compressor, visible_entries
from dsinfer.layers.indexer import Indexer
from dsinfer.layers.norm import RMSNorm, rms_normalize
from dsinfer.layers.rotary import apply_rope, rope_angles
from dsinfer.models.batch import PackedBatch


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, compress_ratio: int) -> None:
        super().__init__()
        self.config = config
        self.n_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.window = config.sliding_window
        self.compress_ratio = compress_ratio
        self.softmax_scale = self.head_dim**-0.5
        self.wq_a = nn.Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        group_in = self.n_heads * self.head_dim // config.o_groups
        self.wo_a = nn.Linear(group_in, config.o_groups * config.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(config.o_groups * config.o_lora_rank, config.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if compress_ratio:
            overlap = compress_ratio == config.csa_ratio
            self.compressor = Compressor(
                config.hidden_size, self.head_dim, compress_ratio, overlap, config.rms_norm_eps
            )
            if overlap:
                self.indexer = Indexer(config)

    def forward(self, x: torch.Tensor, batch: PackedBatch, inv_freq: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] packed; ``inv_freq`` is this layer's RoPE (plain or YaRN-scaled)."""
        cos, sin = rope_angles(batch.positions, inv_freq)
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).view(-1, self.n_heads, self.head_dim)
        q = apply_rope(rms_normalize(q, self.config.rms_norm_eps), cos, sin)
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)

        outputs = []
        for span in batch.sequence_slices():
            positions = batch.positions[span]
            compressed, compressed_visible = self._compressed_entries(x[span], q_latent[span], positions, inv_freq)
            outputs.append(self._attend(q[span], kv[span], positions, compressed, compressed_visible))
        out = apply_rope(torch.cat(outputs), cos, sin, inverse=True)
        return self._project_out(out)

    def _compressed_entries(
        self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Compressed KV of one sequence and the [S, W] mask of entries each query sees."""
        if self.compressor is None:
            return None, None
        compressed = self.compressor(x, inv_freq)
        if self.indexer is not None:
            return compressed, self.indexer(x, q_latent, positions, inv_freq)
        entry = torch.arange(compressed.shape[0], device=x.device)
        return compressed, entry < visible_entries(positions, self.compress_ratio)[:, None]

    def _attend(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        positions: torch.Tensor,
        compressed: torch.Tensor | None,
        compressed_visible: torch.Tensor | None,
    ) -> torch.Tensor:
        """Softmax attention of one sequence's queries [S, H, D] over its window and compressed entries."""
        distance = positions[:, None] - positions[None, :]
        window_visible = (distance >= 0) & (distance < self.window)
        keys, visible = kv, window_visible
        if compressed is not None:
            keys = torch.cat([kv, compressed.to(kv.dtype)])
            visible = torch.cat([window_visible, compressed_visible], dim=1)
        logits = torch.einsum("shd,kd->hsk", q, keys).float() * self.softmax_scale
        logits = logits.masked_fill(~visible.unsqueeze(0), float("-inf"))
        sink = self.attn_sink.float().view(-1, 1, 1).expand(-1, logits.shape[1], 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
        return torch.einsum("hsk,kd->shd", probs.to(keys.dtype), keys)

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output projection: each head group through its own slice of ``wo_a``."""
        groups = self.config.o_groups
        grouped = out.reshape(out.shape[0], groups, -1)
        weight = self.wo_a.weight.view(groups, -1, grouped.shape[-1])
        mixed = torch.einsum("tgi,goi->tgo", grouped, weight).flatten(1)
        return self.wo_b(mixed)
