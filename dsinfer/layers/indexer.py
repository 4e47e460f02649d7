"""The lightning indexer of CSA layers: pick, per query, the compressed entries worth attending to.

score(t, w) = sum_h weight_h(x_t) * ReLU(q_{t,h} . k_w), with its own ratio-4 compressor for the keys
``k_w`` (cached like the main entries) and its own query projection from the attention's low-rank query;
only the ``index_topk`` best visible entries survive.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.config import ModelConfig
from dsinfer.kv.batch import DeviceSpans, SequenceSpan
from dsinfer.kv.cache_v4 import CompressorCache
from dsinfer.layers.compressor import Compressor, read_entries, visible_entries
from dsinfer.layers.rotary import apply_rope, rope_angles
from dsinfer.ops.indexer.reference import indexer_scores
from dsinfer.ops.registry import OpTable, resolve
from dsinfer.ops.topk import topk_indices


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.topk, self.ratio = config.index_topk, config.csa_ratio
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(
            config.hidden_size, self.head_dim, config.csa_ratio, overlap=True, norm_eps=config.rms_norm_eps
        )
        self.ops: OpTable | None = None  # bound by the model (bind_ops); None: chosen on first use

    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        span: SequenceSpan,
        cache: CompressorCache,
        inv_freq: torch.Tensor,
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Boolean [n, W] mask of the compressed entries each new query of one sequence attends to."""
        self.compressor.update(x, positions, span, cache, inv_freq, block_table)
        n_entries = (span.start + span.length) // self.ratio
        if n_entries == 0:
            return torch.zeros(x.shape[0], 0, dtype=torch.bool, device=x.device)
        table = span.block_table if block_table is None else block_table
        keys = read_entries(cache, table, n_entries).float()
        scores = self._scores(x, q_latent, positions, keys, inv_freq)
        visible = torch.arange(n_entries, device=x.device) < visible_entries(positions, self.ratio)[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        chosen = topk_indices(scores, min(self.topk, n_entries))
        selected = torch.zeros_like(visible).scatter_(1, chosen, True)
        return selected & visible

    def _scores(
        self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, inv_freq
    ) -> torch.Tensor:
        """score [n, W] = sum_h weight_h(x) * ReLU(q_h . k_w) / sqrt(d): keys [W, d] shared, or [n, W, d] per query."""
        return indexer_scores(*self._queries(x, q_latent, positions, inv_freq), keys)

    def _queries(
        self, x: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor, inv_freq
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotated queries [n, heads, d] and the per-head weights [n, heads], both float32."""
        q = self.wq_b(q_latent).view(-1, self.n_heads, self.head_dim)
        cos, sin = rope_angles(positions, inv_freq)
        return apply_rope(q, cos, sin).float(), self.weights_proj(x).float() * self.n_heads**-0.5

    def select_decode(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        spans: DeviceSpans,
        cache: CompressorCache,
        inv_freq: torch.Tensor,
        trash: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One query per sequence: the chosen entries [B, k] (ascending) and which of them are real [B, k].

        The keys of every block-table slot are scored and the invisible ones masked, so shapes depend only on
        the block tables' width, never on a value read from the device.
        """
        self.compressor.update_decode(x, positions, spans, cache, inv_freq, trash)
        q, head_weights = self._queries(x, q_latent, positions, inv_freq)
        ops = self.ops if self.ops is not None else resolve(x.device, x.dtype)
        visible = visible_entries(positions, self.ratio)
        return ops.indexer_topk_decode(q, head_weights, cache.entries, spans.block_tables, visible, self.topk)
