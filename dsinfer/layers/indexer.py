"""Lightning indexers: pick, per query, the compressed entries worth attending to.

score(t, w) = sum_h weight_h(x_t) * ReLU(q_{t,h} . k_w) / sqrt(d), with the query projected from the
attention's low-rank query; only the ``index_topk`` best visible entries survive. :class:`IndexScorer` is that
rule, shared by both variants (its arithmetic is the ``index_scores`` / ``index_topk`` ops). V4's
:class:`Indexer` owns a ratio-4 compressor for its keys (cached like the main entries); V4.1's index sources
(``dsinfer.layers.csa2``) score keys a KV source published.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

from dsinfer.config import ModelConfig, ModelConfigBase
from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v4 import CompressorCache
from dsinfer.layers.compressor import Compressor, read_entries, visible_entries
from dsinfer.layers.op_binding import reference_ops
from dsinfer.layers.rotary import apply_rope, rope_angles, step_rope_angles
from dsinfer.ops.index_scores_paged import PagedIndexInputs
from dsinfer.ops.registry import OpTable
from dsinfer.ops.topk import topk_indices

SCORE_SLICE_BYTES = 512 * 2**20
"""The most bytes of float32 scores [rows, W] a prefill computes at once: a chunk scores its queries in row slices
of this size. One dense [n, W] would not fit beside the weights at long contexts (16,384 queries against 131,072
ratio-1 entries: 8 GiB, and the selection copies it). A row's scores and choice read no other row, so the slices
choose what the whole chunk would."""

Choice = TypeVar("Choice")


def score_row_slices(count: int, width: int) -> list[slice]:
    """Consecutive row slices covering ``count`` queries, each one's float32 scores against ``width`` entries
    within :data:`SCORE_SLICE_BYTES` (at least one row a slice; no queries: one empty slice)."""
    rows = max(1, SCORE_SLICE_BYTES // (4 * max(width, 1)))
    return [slice(start, min(start + rows, count)) for start in range(0, max(count, 1), rows)]


def top_k_visible(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean [n, W]: each row's ``k`` best finite scores (fewer when fewer are finite)."""
    width = scores.shape[-1]
    selected = torch.zeros_like(scores, dtype=torch.bool)
    if width == 0:
        return selected
    chosen = topk_indices(scores, min(k, width))
    return selected.scatter_(-1, chosen, scores.gather(-1, chosen) > float("-inf"))


class IndexScorer(nn.Module):
    """The indexer's query side: ``wq_b`` (from the attention's low-rank query) and per-head ``weights_proj``."""

    def __init__(self, config: ModelConfigBase, ratio: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.topk, self.ratio = config.index_topk, ratio
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.ops: OpTable = reference_ops()  # the model binds its table when it is built
        self.head_scale: torch.Tensor | None = None  # float32 [H] of n_heads^-0.5, on the weights' device

    def scaled_head_weights(self, weights: torch.Tensor) -> torch.Tensor:
        """``weights.float() * n_heads^-0.5`` in one kernel: the product with a float32 [H] vector of the scale
        promotes to float32 and multiplies the widened weights by the same float32 scale, bit for bit."""
        if weights.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return weights.float() * self.n_heads**-0.5
        scale = self.head_scale
        if scale is None or scale.device != weights.device:
            scale = torch.full((self.n_heads,), self.n_heads**-0.5, dtype=torch.float32, device=weights.device)
            self.head_scale = scale
        return weights * scale

    def scores(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        inv_freq: torch.Tensor,
        rotate_queries: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        projected: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """score [n, W] against keys [W, d] shared, or [n, W, d] per query, invisible entries -inf.

        ``rotate_queries(q, cos, sin)``: V4.1's RoPE and trained-in rounding of the queries (None: V4, the RoPE
        alone); ``projected``: see :meth:`queries`.
        """
        q, head_weights = self.queries(x, q_latent, positions, inv_freq, rotate_queries, projected=projected)
        score = self.ops.index_scores
        return score(q, keys, head_weights, visible_entries(positions, self.ratio))

    def choose_by_row_slices(
        self,
        queries: tuple[torch.Tensor, torch.Tensor],
        keys: torch.Tensor,
        visible: torch.Tensor,
        choose: Callable[[slice, torch.Tensor], Choice],
    ) -> list[Choice]:
        """``choose(rows, scores)`` for each row slice of the queries (:func:`score_row_slices`), in order: a
        prefill's scores [rows, W] against keys [W, d] (or [n, W, d] per query), invisible entries -inf, one slice
        alive at a time.

        ``queries``: the chunk's queries [n, H, d] and scaled head weights [n, H] (:meth:`queries`, projected once
        for the chunk); ``visible`` [n]: how many leading entries each query sees."""
        q, head_weights = queries
        chosen = []
        for rows in score_row_slices(q.shape[0], keys.shape[-2]):
            row_keys = keys if keys.dim() == 2 else keys[rows]
            chosen.append(choose(rows, self.ops.index_scores(q[rows], row_keys, head_weights[rows], visible[rows])))
        return chosen

    def queries(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor | None,
        rotate_queries: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        angles: tuple[torch.Tensor, torch.Tensor] | None = None,
        projected: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE'd (and, V4.1, rounded) queries [n, H, d] and the scaled per-head weights [n, H].

        ``rotate_queries(q, cos, sin)``: V4.1's RoPE and rounding of the projected queries (None: the RoPE alone).
        ``angles``: the positions' cos and sin when the caller has them already (else computed from ``inv_freq``).
        ``projected``: outputs of the caller's joined GEMMs, ``index_q`` (``wq_b(q_latent)``) and ``index_weights``
        (``weights_proj(x)``); those present stand in for this scorer's own."""
        projected = projected or {}
        cos, sin = angles if angles is not None else rope_angles(positions, inv_freq)
        q = projected["index_q"] if "index_q" in projected else self.wq_b(q_latent)
        q = q.view(-1, self.n_heads, self.head_dim)
        q = rotate_queries(q, cos, sin) if rotate_queries is not None else apply_rope(q, cos, sin, ops=self.ops)
        weights = projected["index_weights"] if "index_weights" in projected else self.weights_proj(x)
        return q, self.scaled_head_weights(weights)


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
        projected: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The compressed entries each new query of one sequence attends to: [n, min(k, W)] entry numbers in
        ascending order, -1 after the real ones (a query with fewer than k visible entries).

        ``projected``: the attention's joined GEMMs' outputs for these tokens (:meth:`select_decode`)."""
        projected = projected or {}
        compressor_input = projected.get("index_compressor")
        self.compressor.update(x, positions, span, cache, inv_freq, block_table, compressor_input)
        n_entries = (span.start + span.length) // self.ratio
        if n_entries == 0:
            return torch.zeros(x.shape[0], 0, dtype=torch.long, device=x.device)
        table = span.block_table if block_table is None else block_table
        # plain keys: the cache's dtype; FP8 ones decoded exactly, to bf16 beside bf16 queries (the tensor cores)
        decoded = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        keys = read_entries(cache, table, n_entries, self.ops, decoded)
        queries = self.queries(x, q_latent, positions, inv_freq, projected=projected)
        # the one-program selection per query (``index_topk_decode``: its contract is this list's) instead of a
        # top-k over packed keys and two sorts; row slices bound the scores' memory
        select = self.ops.index_topk_decode
        visible = visible_entries(positions, self.ratio)
        return torch.cat(self.choose_by_row_slices(queries, keys, visible, lambda _, scores: select(scores, self.topk)))

    def select_decode(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        batch: PackedBatch,
        cache: CompressorCache,
        inv_freq: torch.Tensor,
        projected: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One query per sequence: the chosen entries [B, k] (ascending) and which of them are real [B, k].

        The keys of every block-table slot are scored and the invisible ones masked, so shapes depend only on
        the block tables' width, never on a value read from the device.

        ``projected``: outputs of the attention's joined GEMMs, by name: ``index_compressor`` (the compressor's
        values and gates, ``x`` through its ``joined_projection``), ``index_weights`` and ``index_q`` (see
        :meth:`queries`); what is missing is projected here.
        """
        projected = projected or {}
        self.compressor.update_decode(x, batch, cache, inv_freq, projected.get("index_compressor"))
        return self.choose_decode(x, q_latent, batch, cache, inv_freq, projected)

    def choose_decode(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        batch: PackedBatch,
        cache: CompressorCache,
        inv_freq: torch.Tensor,
        projected: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`select_decode` once the step's keys are in ``cache`` (a verify step writes every column's
        first): one query a row, each masked to the entries its own position sees."""
        positions, spans = batch.positions, batch.device_spans
        angles = step_rope_angles(batch, inv_freq, ops=self.ops)
        q, head_weights = self.queries(x, q_latent, positions, inv_freq, angles=angles, projected=projected)
        ops = self.ops
        visible = visible_entries(positions, self.ratio)
        inputs = PagedIndexInputs(q, head_weights, cache.entries, cache.entry_scales, spans.block_tables, visible)
        return ops.indexer_topk_decode(inputs, self.topk)
