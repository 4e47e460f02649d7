"""Lightning indexers: pick, per query, the compressed entries worth attending to.

score(t, w) = sum_h weight_h(x_t) * ReLU(q_{t,h} . k_w) / sqrt(d), with the query projected from the
attention's low-rank query; only the ``index_topk`` best visible entries survive. :class:`IndexScorer` is that
rule, shared by both variants. V4's :class:`Indexer` owns a ratio-4 compressor for its keys (cached like the
main entries); V4.1's index sources (``dsinfer.layers.csa2``) score keys a KV source published.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.config import ModelConfig, ModelConfigBase
from dsinfer.kv.batch import DeviceSpans, SequenceSpan
from dsinfer.kv.cache_v4 import CompressorCache
from dsinfer.layers.compressor import Compressor, gather_entries, read_entries, visible_entries
from dsinfer.layers.rotary import apply_rope, rope_angles
from dsinfer.ops.topk import topk_indices


def hide_invisible(scores: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """``scores`` [n, W] with -inf at the entries each query position may not see yet (entry w needs its window)."""
    visible = torch.arange(scores.shape[-1], device=scores.device) < visible_entries(positions, ratio)[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def top_k_visible(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean [n, W]: each row's ``k`` best finite scores (fewer when fewer are finite)."""
    width = scores.shape[-1]
    selected = torch.zeros_like(scores, dtype=torch.bool)
    if width == 0:
        return selected
    chosen = topk_indices(scores, min(k, width))
    return selected.scatter_(-1, chosen, scores.gather(-1, chosen) > float("-inf"))


def top_k_in_order(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` best entries [B, k] in ascending entry order, and which are real (finite) [B, k].

    Position order is how the per-sequence path reads its selection (the same sums in the same order).
    """
    width = scores.shape[1]
    chosen = topk_indices(scores, min(k, width))
    real = scores.gather(1, chosen) > float("-inf")
    order = torch.sort(torch.where(real, chosen, chosen + width), dim=1).indices
    return chosen.gather(1, order), real.gather(1, order)


class IndexScorer(nn.Module):
    """The indexer's query side: ``wq_b`` (from the attention's low-rank query) and per-head ``weights_proj``."""

    def __init__(self, config: ModelConfigBase, ratio: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.topk, self.ratio = config.index_topk, ratio
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)

    def scores(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        inv_freq: torch.Tensor,
        round_queries: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """score [n, W] against keys [W, d] shared, or [n, W, d] per query, invisible entries -inf.

        ``round_queries`` is V4.1's trained-in rounding of the RoPE'd queries (None: V4, no rounding).
        """
        cos, sin = rope_angles(positions, inv_freq)
        q = apply_rope(self.wq_b(q_latent).view(-1, self.n_heads, self.head_dim), cos, sin)
        if round_queries is not None:
            q = round_queries(q)
        spec = "shd,wd->shw" if keys.dim() == 2 else "shd,swd->shw"
        per_head = F.relu(torch.einsum(spec, q.float(), keys.float())) * self.head_dim**-0.5
        head_weights = self.weights_proj(x).float() * self.n_heads**-0.5
        return hide_invisible((per_head * head_weights.unsqueeze(-1)).sum(dim=1), positions, self.ratio)


class Indexer(IndexScorer):
    """V4's indexer: the scorer plus its own overlapping ratio-4 key compressor."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, config.csa_ratio)
        self.compressor = Compressor(
            config.hidden_size, self.head_dim, config.csa_ratio, overlap=True, norm_eps=config.rms_norm_eps
        )

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
        return top_k_visible(self.scores(x, q_latent, positions, keys, inv_freq), self.topk)

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
        keys = gather_entries(cache, spans)
        return top_k_in_order(self.scores(x, q_latent, positions, keys, inv_freq), self.topk)
