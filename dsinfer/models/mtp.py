"""The V4 multi-token-prediction (MTP) layer: drafts the token after next from the target's streams.

For position i it combines the target model's residual streams at i (before ``hc_head``) with the
embedding of token i + 1 (``e_proj(enorm(embed))`` broadcast over the streams plus ``h_proj(hnorm(streams))``),
runs one full window-only block, collapses with its own ``hc_head`` and norm, and reads logits through the
target's shared output head. Speculative decoding drives it (:mod:`dsinfer.speculative.mtp`).
Its block parameters sit directly under ``mtp.N.`` as in the official checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.config import ModelConfig
from dsinfer.kv.batch import PackedBatch
from dsinfer.layers.mhc import hyper_head
from dsinfer.layers.norm import RMSNorm
from dsinfer.models.block import Block


class MTPLayer(Block):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__(config, layer_id, compress_ratio=0, hash_routed=False)
        dim, n = config.hidden_size, config.hc_mult
        self.enorm = RMSNorm(dim, config.rms_norm_eps)
        self.hnorm = RMSNorm(dim, config.rms_norm_eps)
        self.e_proj = nn.Linear(dim, dim, bias=False)
        self.h_proj = nn.Linear(dim, dim, bias=False)
        self.norm = RMSNorm(dim, config.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * dim, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def draft_hidden(
        self,
        target_streams: torch.Tensor,
        next_token_embeddings: torch.Tensor,
        next_token_ids: torch.Tensor,
        batch: PackedBatch,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        """Final hidden states [T, hidden] of the draft for every packed position."""
        streams = self.draft_streams(target_streams, next_token_embeddings, next_token_ids, batch, inv_freq)
        return self.collapse(streams)

    def draft_streams(
        self,
        target_streams: torch.Tensor,
        next_token_embeddings: torch.Tensor,
        next_token_ids: torch.Tensor,
        batch: PackedBatch,
        inv_freq: torch.Tensor,
    ) -> torch.Tensor:
        """The block's output streams [T, hc_mult, hidden]: what a chained draft step takes as its input streams."""
        token_part = self.e_proj(self.enorm(next_token_embeddings)).unsqueeze(1)
        streams = token_part + self.h_proj(self.hnorm(target_streams))
        return self(streams, batch, inv_freq, next_token_ids)

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """Streams to final hidden states [T, hidden]: the layer's own ``hc_head``, then its norm."""
        cfg = self.config
        collapsed = hyper_head(
            streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg.hc_eps, cfg.rms_norm_eps, self.ops
        )
        return self.norm(collapsed)
