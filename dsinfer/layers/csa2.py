"""DeepSeek-V4.1 attention (CSA2): a sliding window per layer plus compressed KV shared across layers.

Every layer attends to its ``sliding_window`` tokens (K = V = ``kv_norm(wkv x)``, RoPE'd, FP8-rounded). Layers
with a compress ratio also attend to compressed entries, but only **KV-source** layers compute them:

* ratio 2: each pair of tokens is pooled by a per-channel softmax over ``wgate x`` of ``wkv x`` (in fp32),
  then RMSNorm; ratio 1: ``norm(wkv x)`` per token (the CED decoder's global KV);
* the latent (before RoPE) also gives the **index keys** ``k_norm(wk(latent))``; both are RoPE'd at the
  group's first position and rounded (entries FP4/16/e4m3, keys FP4/32/ue8m0) before they are cached.

Later layers reuse the latest source's entries. **Index-source** layers score the entries (sum over heads
of ``weights_proj(x) * ReLU(q . k)``) against the latest source's keys and keep the top ``index_topk``
visible ones; the layers after them reuse that choice. The candidate source additionally keeps the best
``candidate_topk_blocks`` blocks of ``candidate_block_size`` entries (the newest block always) and every
later index source chooses only inside those blocks.

Within a forward, what a source publishes for the layers after it lives in a
:class:`~dsinfer.layers.csa2_state.PublishedState` (per sequence, or once for a decode or verify step); what
outlives the forward (windows, unfinished groups, entries, keys) lives in the cache, read and written through its
methods whichever storage it uses (model dtype, or FP8 / FP4 codes and scales).
A later source *replaces* what an earlier one published (the reference's cached path; its uncached path
concatenates, which is a bug: see docs/model.md).

Prefill attention is V4's op, ``sparse_attention_prefill``, once per layer for the whole packed batch: the
sources compress and the index sources choose per sequence first (``index_scores`` in row slices, then the
``index_topk_decode`` and ``candidate_block_mask`` a decode step chooses with), then the op reads each token's
window (new rows, earlier positions from the ring) and its chosen entries of the reused source, through the views
:mod:`dsinfer.layers.csa2_prefill` makes of the cache (its tensors as they are in model-dtype storage, decoded
rings and entry blocks in coded storage).

A decode step attends through :meth:`KVCacheV41.attend_decode`, which reads the ring and the chosen entries where
they are stored: V4's ``sparse_attention_decode`` in model-dtype storage, ``sparse_attention_decode_coded`` (codes
decoded as they load) in coded storage. The index sources score the source's keys in place too
(``index_scores_paged``) and choose with ``index_topk_decode``, the candidate source with ``candidate_block_mask``:
one op each, nothing gathered.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.config import ModelConfigV41
from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.kv.fixed_width import FixedWidthBatch, PendingJournal
from dsinfer.layers.attention import Attention
from dsinfer.layers.compressor import Compressor, decode_entry_location, kept_entries, visible_entries
from dsinfer.layers.csa2_prefill import (
    candidate_block_rows,
    candidate_entries,
    entries_view,
    packed_indices,
    window_view,
    write_windows,
)
from dsinfer.layers.csa2_state import DecodeState, PrefillViews, PublishedState, SequenceState, SourceEntries
from dsinfer.layers.indexer import IndexScorer
from dsinfer.layers.joined_linear import JoinedLinears
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.rotary import RoundingPoint, apply_rope, rope_and_round, rope_angles, step_rope_angles
from dsinfer.ops.fake_quant import ActivationQuantizer
from dsinfer.ops.index_scores_paged import PagedIndexInputs
from dsinfer.ops.index_select import candidate_block_mask_reference
from dsinfer.ops.rope_round import RowChain
from dsinfer.ops.side_stream import beside
from dsinfer.ops.sparse_attention.prefill_reference import SparsePrefillInputs

select_candidate_blocks = candidate_block_mask_reference
"""Boolean mask shaped like ``scores`` [n, W]: the entries of each query's best ``topk_blocks`` blocks (the op's
truth, :mod:`dsinfer.ops.index_select`): a block scores its best entry, the newest visible block always kept."""


class IndexerV41(IndexScorer):
    """An index source's scorer; on KV-source layers it also owns the index-key projection (``wk``, ``k_norm``)."""

    def __init__(self, config: ModelConfigV41, layer_id: int) -> None:
        super().__init__(config, config.compress_ratios[layer_id])
        self.layer_id = layer_id
        self.is_candidate_source = layer_id == config.candidate_source_layer_id
        self.uses_candidates = config.uses_candidates(layer_id)
        self.candidate_topk_blocks, self.candidate_block_size = (
            config.candidate_topk_blocks,
            config.candidate_block_size,
        )
        self.owns_keys = config.is_kv_source(layer_id)
        if self.owns_keys:
            self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def keys(
        self,
        latents: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        quantizer: ActivationQuantizer,
        layer_id: int,
        entry_ids: torch.Tensor,
        defer: bool = False,
    ) -> torch.Tensor | RowChain:
        """Index keys ``k_norm(wk(latent))`` of new entries, RoPE'd at their groups' first positions, rounded
        (``defer``: as :func:`rope_and_round`'s, for a cache write)."""
        return rope_and_round(
            self.wk(latents),
            cos,
            sin,
            self.ops,
            self.k_norm,
            RoundingPoint(quantizer, "index_keys", layer_id, entry_ids),
            defer,
        )

    def prefill_choice(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        keys: torch.Tensor,
        inv_freq: torch.Tensor,
        state: SequenceState,
        quantizer: ActivationQuantizer,
    ) -> torch.Tensor:
        """One sequence's prefill choice [n, min(k, W)] (keys [W, d]): entry numbers ascending, then -1 where fewer
        are finite (the list a decode step of the same position chooses).

        One ``index_topk_decode`` a row slice of the queries (:meth:`choose_by_row_slices`: the float32 scores
        [rows, W] stay within a fixed budget). The candidate source records its blocks in ``state``
        (``candidate_blocks``, a boolean per block, written slice by slice); a later index source limits each slice
        to the entries of those rows' blocks (the selection's mask)."""
        queries = self.queries(x, q_latent, positions, inv_freq, self._query_rotation(quantizer, positions))
        visible = visible_entries(positions, self.ratio)
        width, block_size = keys.shape[0], self.candidate_block_size
        limit = state.candidate_blocks if self.uses_candidates else None
        blocks = None
        if self.is_candidate_source:  # written slice by slice: no list of pieces beside a joined copy
            blocks = torch.empty((x.shape[0], -(-width // block_size)), dtype=torch.bool, device=x.device)

        def choose(rows: slice, scores: torch.Tensor) -> torch.Tensor:
            allowed = None
            if blocks is not None:  # the candidate source records its blocks and is not limited by them
                mask = self.ops.candidate_block_mask(scores, visible[rows], self.candidate_topk_blocks, block_size)
                blocks[rows] = candidate_block_rows(mask, block_size)
            elif limit is not None:
                allowed = candidate_entries(limit[rows], block_size, width)
            return self.ops.index_topk_decode(scores, self.topk, allowed)

        indices = torch.cat(self.choose_by_row_slices(queries, keys, visible, choose))
        if blocks is not None:
            state.candidate_blocks = blocks
        return indices

    def decode_choice(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        positions: torch.Tensor,
        paged_keys: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor],
        angles: tuple[torch.Tensor, torch.Tensor],
        state: DecodeState,
        quantizer: ActivationQuantizer,
        projected: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """A decode step's choice [B, min(k, W)]: the entries chosen (ascending), then -1.

        ``paged_keys`` is the source's key pool, its scales (coded storage) and the step's block tables: the
        scores read the keys in place (``index_scores_paged``), one selection op chooses (``index_topk_decode``),
        with the candidate blocks as its ``allowed`` mask. ``angles``: the positions' cos and sin (the step's);
        ``projected``: the caller's joined GEMMs' ``index_q`` and ``index_weights``
        (see :meth:`queries`). ``state`` (the step's) also keeps how many entries each query sees, per ratio."""
        keys, key_scales, tables = paged_keys
        rotation = self._query_rotation(quantizer, positions)
        q, head_weights = self.queries(x, q_latent, positions, None, rotation, angles, projected)
        ops = self.ops
        visible = state.visible.get(self.ratio)  # entries each query sees: once per step and ratio
        if visible is None:
            visible = state.visible[self.ratio] = visible_entries(positions, self.ratio)
        scores = ops.index_scores_paged(PagedIndexInputs(q, head_weights, keys, key_scales, tables, visible))
        return ops.index_topk_decode(scores, self.topk, self._candidates(x, scores, visible, state))

    def _query_rotation(self, quantizer: ActivationQuantizer, positions: torch.Tensor):
        """The queries' RoPE and rounding (``index_queries``) at ``positions``, one op on the fast path."""

        def rotate_queries(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            return rope_and_round(
                q, cos, sin, self.ops, None, RoundingPoint(quantizer, "index_queries", self.layer_id, positions)
            )

        return rotate_queries

    def _candidates(
        self, x: torch.Tensor, scores: torch.Tensor, visible: torch.Tensor, state: DecodeState
    ) -> torch.Tensor | None:
        """The candidate source records its blocks in ``state`` (and is not limited by them); later index sources
        get the recorded mask; None: no limit."""
        if self.is_candidate_source:
            state.candidates = self.ops.candidate_block_mask(
                scores, visible, self.candidate_topk_blocks, self.candidate_block_size
            )
        elif self.uses_candidates:
            return state.candidates
        return None


class AttentionV41(Attention):
    """Shared-KV MQA with a window and (ratio > 0) the shared compressed entries; V4's window and projections."""

    def __init__(self, config: ModelConfigV41, layer_id: int) -> None:
        super().__init__(config, compress_ratio=0)  # V4's projections, norms and sinks; its compressors are V4's
        self.layer_id = layer_id
        self.compress_ratio = config.compress_ratios[layer_id]
        self.compressor = None
        if config.is_kv_source(layer_id):  # V4's compressor without the slot bias or overlap, pooling in fp32
            self.compressor = Compressor(
                config.hidden_size, self.head_dim, self.compress_ratio, False, config.rms_norm_eps,
                slot_bias=False, pool_in_fp32=True,
            )  # fmt: skip
        self.indexer = IndexerV41(config, layer_id) if config.is_index_source(layer_id) else None

    def join_projections(self) -> None:
        """Inference: every projection of the layer input in one GEMM, every projection of the low-rank query in
        another (see ``JoinedLinears``); the parameters become views of the stacks' rows, names unchanged.

        Input rows, in order: ``q_a`` (``wq_a``), ``kv`` (``wkv``), a ratio-1 KV source's ``compressor`` (its
        ``wkv``: no gate, model dtype), an index source's ``index_weights`` (the scorer's ``weights_proj``); query
        rows: ``q`` (``wq_b``), ``index_q`` (the scorer's ``wq_b``). A ratio-2 source's compressor pools in fp32
        and projects on its own (its ``join_projections`` stacks its values and gates). Projections of another
        kind or dtype (FP8 kept as stored) stay on their own. Prefill multiplies only the ``q_a`` and ``kv`` rows
        (and ``q``): its sources and scorers project per sequence; a decode step uses every row."""
        compressor, indexer = self.compressor, self.indexer
        groups: dict[str, tuple[nn.Module, ...]] = {"q_a": (self.wq_a,), "kv": (self.wkv,)}
        if compressor is not None and compressor.wgate is None:
            groups["compressor"] = (compressor.wkv,)
        if indexer is not None:
            groups["index_weights"] = (indexer.weights_proj,)
        self.joined_inputs = JoinedLinears.join(groups, self.joined_inputs)
        queries = {"q": (self.wq_b,), "index_q": (indexer.wq_b,)} if indexer is not None else {}
        self.joined_queries = JoinedLinears.join(queries, self.joined_queries)

    def forward(
        self,
        x: torch.Tensor,
        batch: PackedBatch,
        inv_freq: torch.Tensor,
        published: PublishedState,
        quantizer: ActivationQuantizer,
        compressor_only: bool = False,
    ) -> torch.Tensor | None:
        """x: [T, hidden] packed. ``published``: what this forward's sources publish for the layers after them.

        ``compressor_only`` (CED prefill) runs just the source's compressor and index keys: it fills the
        cache's compressed entries for the batch and returns None.
        """
        cache: KVCacheV41 = batch.cache
        cache.check_fake_quantization(quantizer.enabled)
        if batch.fixed_width is not None:  # a verify forward: every row as a decode step of its position
            state = published.decode
            return self._forward_columns(x, batch.fixed_width, inv_freq, state, quantizer, batch.column_journal)
        if batch.is_decode and not compressor_only:
            return self._forward_decode(x, batch, inv_freq, published.decode, quantizer)
        # The step's device block tables (built once per step from the host's spans): a table copied from a host
        # list in every layer would make the host wait for the copy.
        tables = batch.device_spans.block_tables if self.compressor is not None else None
        if compressor_only:
            states = published.sequences
            for row, (span, tokens, state) in enumerate(zip(batch.spans, batch.sequence_slices(), states, strict=True)):
                self._publish(x[tokens], span, tables[row], cache, inv_freq, state, quantizer)
            return None
        angles = step_rope_angles(batch, inv_freq, ops=self.ops)  # one computation per forward, shared by the layers
        cos, sin, q_latent, q, kv = self._queries_and_kv(x, batch.positions, inv_freq, quantizer, angles)
        entries, tables, indices, ratio = None, batch.device_spans.block_tables, None, 0
        if self.compress_ratio:
            views = self._sources_prefill(x, q_latent, batch, cache, inv_freq, published, quantizer)
            entries, tables, indices, ratio = views.entries, views.entry_tables, views.indices, views.ratio
        out = self._attend_packed(q, kv, batch, cache, entries, tables, indices, ratio)
        out = apply_rope(out, cos, sin, inverse=True, ops=self.ops, in_place=True)
        return self._project_out(out)

    def _forward_columns(
        self,
        x: torch.Tensor,
        batch: FixedWidthBatch,
        inv_freq: torch.Tensor,
        state: DecodeState,
        quantizer: ActivationQuantizer,
        journal: PendingJournal,
    ) -> torch.Tensor:
        """Every row of a fixed-width (verify) batch as a decode step of its position would compute it: the
        projections over all rows; a KV source's compressor update column by column, in position order (journaled
        for the rollback), then its entries and index keys of every row at once; then every row at once, in the
        packed order (``batch.all_rows()``, one ``state`` for all of them): the index sources' choice and one decode
        attention, each row over the window of its own position (:meth:`KVCacheV41.attend_verify`), after which the
        step's rows join the ring.

        Writing every column's entries first is safe: an entry a later column completes is never visible to an
        earlier one (its number is at least that column's visible count)."""
        rows = batch.all_rows()
        cos, sin = step_rope_angles(rows, inv_freq, ops=self.ops)  # once per forward, shared by the layers
        projected = {}
        q_a, kv = self._input_rows(x, cos, sin, rows.positions, quantizer, projected, True, False)
        q_latent, q = self._queries(q_a, cos, sin, projected, True)
        cache: KVCacheV41 = batch.cache
        if self.compress_ratio and self.compressor is not None:
            self._write_verify_entries(x, batch, rows, inv_freq, quantizer, projected.get("compressor"), journal)
            state.entries_layer = self.layer_id
        chosen = self._choose(x, q_latent, rows, inv_freq, state, quantizer, projected)
        out = cache.attend_verify(self.ops, self.layer_id, chosen, q, batch, kv, self.attn_sink, self.softmax_scale)
        return self._project_out(apply_rope(out, cos, sin, inverse=True, ops=self.ops, in_place=True))

    def _write_verify_entries(self, x, batch: FixedWidthBatch, rows: PackedBatch, inv_freq, quantizer, projected,
                              journal: PendingJournal) -> None:  # fmt: skip
        """A KV source's entries and index keys of every verify row (``x``, the packed rows): at ratio 1 (no
        unfinished groups) all rows at once, else the compressor's update column by column (each column's recorded
        in ``journal``), then every row's entry rounded, keyed and written at once."""
        cache: KVCacheV41 = batch.cache
        source = cache.layers[self.layer_id].source
        if source is None or source.pending_values is None:
            self._write_decode_entries(x, rows, cache, inv_freq, quantizer, projected)
            return
        xs = batch.columns(x)
        by_column = [None] * batch.width if projected is None else batch.columns(projected)

        def column_latents(j: int) -> tuple:
            column = batch.column(j)
            return self.compressor.decode_latents(xs[j], column.positions, column.device_spans, source, by_column[j])

        columns = journal.run_columns([source], column_latents)
        latents, entry_ids, complete = (batch.rows(torch.stack(parts)) for parts in zip(*columns, strict=True))
        self._write_entries(rows, cache, inv_freq, quantizer, latents, entry_ids, complete)

    def _sources_prefill(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        batch: PackedBatch,
        cache: KVCacheV41,
        inv_freq: torch.Tensor,
        published: PublishedState,
        quantizer: ActivationQuantizer,
    ) -> PrefillViews:
        """Prefill: a KV source compresses and publishes per sequence, an index source chooses per sequence; every
        compressed layer gets its source's entries (op layout: paged, block tables), the latest choice as entry
        numbers [T, K] (-1 padding) and the source's ratio (:class:`PrefillViews`, replaced by each later source
        like what the sources publish per sequence)."""
        tables = batch.device_spans.block_tables
        chosen = []
        states = published.sequences
        for row, (span, tokens, state) in enumerate(zip(batch.spans, batch.sequence_slices(), states, strict=True)):
            if self.compressor is not None:
                self._publish(x[tokens], span, tables[row], cache, inv_freq, state, quantizer)
            if self.indexer is not None:
                positions = batch.positions[tokens]
                chosen.append(self.indexer.prefill_choice(
                    x[tokens], q_latent[tokens], positions, state.source.index_keys, inv_freq, state, quantizer
                ))  # fmt: skip
        views = published.prefill
        if self.compressor is not None:
            views.entries, views.entry_tables = entries_view(cache, self.layer_id, tables)
            views.ratio = self.compress_ratio
        if self.indexer is not None:
            views.indices = packed_indices(chosen)
        return views

    def _attend_packed(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        batch: PackedBatch,
        cache: KVCacheV41,
        entries: torch.Tensor | None,
        tables: torch.Tensor,
        indices: torch.Tensor | None,
        ratio: int,
    ) -> torch.Tensor:
        """Every new token of the batch in one ``sparse_attention_prefill`` over its window (new rows, then the ring
        as it was before the step) and the chosen ``entries``; then the newest window rows go to the rings."""
        spans = batch.device_spans
        ring, slots = window_view(cache, self.layer_id, spans, batch.spans, self.window)
        rows = spans.token_rows
        sequence_rows = torch.cat([rows.new_zeros(1), rows + 1])
        ops = self.ops
        out = ops.sparse_attention_prefill(
            SparsePrefillInputs(
                q, kv, batch.positions, sequence_rows, spans.starts, slots, spans.window_from, ring, self.window,
                entries, tables, indices, ratio, self.attn_sink, self.softmax_scale,
                [(span.start, span.length, span.window_from) for span in batch.spans],
            ),
        )  # fmt: skip
        write_windows(cache, self.layer_id, kv, batch, self.window)
        return out

    def _queries_and_kv(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        quantizer: ActivationQuantizer,
        angles: tuple[torch.Tensor, torch.Tensor] | None = None,
        projected: dict[str, torch.Tensor] | None = None,
        defer_kv: bool = False,
    ):
        """RoPE angles, the low-rank query, the RoPE'd queries [T, H, D] and the rounded window K=V [T, D]
        (``defer_kv``: its :class:`RowChain` where it has one, for the ring's write to compute).

        ``angles``: the positions' cos and sin when the caller has them (a forward's memo), else computed here.
        ``projected`` (a decode step): a dict that gets every joined projection by name (see
        :meth:`join_projections`), the sources' and scorer's too, for :meth:`attend_decode`. None: the stacks
        multiply only the rows of ``q_a``, ``kv`` and ``q``."""
        cos, sin = angles if angles is not None else rope_angles(positions, inv_freq)
        every = projected is not None
        projected = {} if projected is None else projected
        q_a, kv = self._input_rows(x, cos, sin, positions, quantizer, projected, every, defer_kv)
        q_latent, q = self._queries(q_a, cos, sin, projected, every)
        return cos, sin, q_latent, q, kv

    def _input_rows(self, x, cos, sin, positions, quantizer, projected: dict, every: bool, defer_kv: bool):
        """The low-rank query ``q_a`` and the rounded window K=V (see :meth:`_queries_and_kv`); ``projected`` gets
        the input stack's projections (``every``: all of them, else only ``q_a``'s and ``kv``'s)."""
        projected.update(_joined(self.joined_inputs, x, None if every else ("q_a", "kv")))
        q_a = projected["q_a"] if "q_a" in projected else self.wq_a(x)
        kv = projected["kv"] if "kv" in projected else self.wkv(x)
        kv = rope_and_round(
            kv,
            cos,
            sin,
            self.ops,
            self.kv_norm,
            RoundingPoint(quantizer, "window_kv", self.layer_id, positions),
            defer_kv,
        )
        return q_a, kv

    def _queries(self, q_a, cos, sin, projected: dict, every: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalised low-rank query and the RoPE'd queries [T, H, D]; ``projected`` gets the query stack's
        projections (``every``: the scorer's too)."""
        q_latent = self.q_norm(q_a)
        projected.update(_joined(self.joined_queries, q_latent, None if every else ("q",)))
        q = projected["q"] if "q" in projected else self.wq_b(q_latent)
        return q_latent, apply_rope(q.view(-1, self.n_heads, self.head_dim), cos, sin, ops=self.ops)

    def _forward_decode(
        self,
        x: torch.Tensor,
        batch: PackedBatch,
        inv_freq: torch.Tensor,
        state: DecodeState,
        quantizer: ActivationQuantizer,
    ) -> torch.Tensor:
        """One token per sequence, every sequence at once, from the step's device metadata (no host reads).

        The RoPE angles (of the positions, and of each compressor group's first position) are the forward's,
        computed by the first layer that asks (``step_rope_angles``)."""
        (cos, sin), projected = step_rope_angles(batch, inv_freq, ops=self.ops), {}
        # The window row's only use is the ring's write: its chain runs there, with the store.
        q_a, kv = self._input_rows(x, cos, sin, batch.positions, quantizer, projected, True, True)
        # The cache writes (the window row, a source's entries and index keys) read none of the queries' work: at
        # decode on CUDA they run on the side stream beside the query projections (dsinfer.ops.side_stream).
        _, (q_latent, q) = beside(
            lambda: self._write_decode_caches(x, kv, batch, inv_freq, state, quantizer, projected),
            lambda: self._queries(q_a, cos, sin, projected, True),
            x,
        )
        out = self._choose_and_attend(x, q, q_latent, batch, inv_freq, state, quantizer, projected)
        return self._project_out(apply_rope(out, cos, sin, inverse=True, ops=self.ops, in_place=True))

    def _write_decode_caches(self, x, kv, batch: PackedBatch, inv_freq, state: DecodeState, quantizer, projected: dict):
        """Decode's cache writes: the window row to the ring; a KV source's entries and index keys (published in
        ``state`` for the later layers)."""
        cache: KVCacheV41 = batch.cache
        cache.write_window(self.layer_id, batch.device_spans.slots, batch.positions, kv)
        if self.compress_ratio and self.compressor is not None:
            self._write_decode_entries(x, batch, cache, inv_freq, quantizer, projected.get("compressor"))
            state.entries_layer = self.layer_id

    def _choose_and_attend(
        self, x, q, q_latent, batch: PackedBatch, inv_freq, state: DecodeState, quantizer, projected
    ) -> torch.Tensor:
        """Decode after the cache writes: an index source's choice (published in ``state``), then the attention
        over the ring and the chosen entries of the layer whose entries this one reads."""
        indices, entries_layer = self._choose(x, q_latent, batch, inv_freq, state, quantizer, projected)
        cache: KVCacheV41 = batch.cache
        return cache.attend_decode(
            self.ops, self.layer_id, entries_layer, q, batch, indices, self.attn_sink, self.softmax_scale
        )

    def _choose(self, x, q_latent, batch: PackedBatch, inv_freq, state: DecodeState, quantizer, projected):
        """The chosen entries [B, k] (an index source chooses and publishes them in ``state``; a layer after it
        reuses them) and the layer whose entries they number; (None, None) in a window-only layer."""
        if not self.compress_ratio:
            return None, None
        if self.indexer is not None:
            cache: KVCacheV41 = batch.cache
            paged_keys = (*cache.index_key_pool(state.entries_layer), batch.device_spans.block_tables)
            angles = step_rope_angles(batch, inv_freq, ops=self.ops)
            state.indices = self.indexer.decode_choice(
                x, q_latent, batch.positions, paged_keys, angles, state, quantizer, projected
            )
        return state.indices, state.entries_layer

    def _write_decode_entries(
        self,
        x: torch.Tensor,
        batch: PackedBatch,
        cache: KVCacheV41,
        inv_freq: torch.Tensor,
        quantizer: ActivationQuantizer,
        projected: torch.Tensor | None = None,
    ) -> None:
        """Decode: every token joins its unfinished group and every group's entry is rounded and written, to the
        sequence's block where the token completed it, to the cache's trash block otherwise (fixed shapes, no
        host data: a CUDA graph can replay it).

        A decode token's window always ends past ``reuse_below`` (a prefix hit covers less than the prompt), so
        no completed entry is one a prefix hit already stored. ``projected``: ``x`` through the compressor's
        projection already (a ratio-1 source's ``wkv`` row of the input stack), else the compressor projects."""
        source = cache.layers[self.layer_id].source
        latents = self.compressor.decode_latents(x, batch.positions, batch.device_spans, source, projected)
        self._write_entries(batch, cache, inv_freq, quantizer, *latents)

    def _write_entries(self, batch: PackedBatch, cache: KVCacheV41, inv_freq: torch.Tensor,
                       quantizer: ActivationQuantizer, latents: torch.Tensor, entry_ids: torch.Tensor,
                       complete: torch.Tensor | None) -> None:  # fmt: skip
        """The rows' pre-RoPE entries (:meth:`Compressor.decode_latents`) RoPE'd, rounded and written with their
        index keys, each to its block where its row completed it, else to the trash block."""
        spans, ratio = batch.device_spans, self.compress_ratio
        cos, sin = step_rope_angles(batch, inv_freq, ratio, self.ops)  # at the group's first position: entry id * ratio
        # The quantizer's entry ids: -1 for the trash writes (at ratio 1 every token completes its entry).
        real_ids = entry_ids if ratio == 1 else torch.where(complete, entry_ids, -1)
        # Entries and keys are only written: their chains run in the writes (one op each with its store).
        entries = rope_and_round(
            latents,
            cos,
            sin,
            self.ops,
            None,
            RoundingPoint(quantizer, "compressed_kv", self.layer_id, real_ids),
            defer=True,
        )
        keys = self.indexer.keys(latents, cos, sin, quantizer, self.layer_id, real_ids, defer=True)
        blocks, block_rows = decode_entry_location(
            spans, entry_ids, complete, cache.block_tokens // ratio, cache.trash_block, self.ops
        )
        cache.write_entries_at(self.layer_id, blocks, block_rows, entries, keys)

    def _publish(
        self,
        x: torch.Tensor,
        span: SequenceSpan,
        block_table: torch.Tensor,
        cache: KVCacheV41,
        inv_freq: torch.Tensor,
        state: SequenceState,
        quantizer: ActivationQuantizer,
    ) -> None:
        """Compress one sequence's new tokens, cache the finished entries and keys, publish all of them.

        ``block_table`` is the sequence's row of the step's device block tables (padded past its blocks)."""
        positions = torch.arange(span.start, span.start + x.shape[0], device=x.device)
        latents, entry_ids = self.compressor.latents(x, positions, span, cache.layers[self.layer_id].source)
        if entry_ids.numel():
            cos, sin = rope_angles(entry_ids * self.compress_ratio, inv_freq)
            entries = rope_and_round(
                latents, cos, sin, self.ops, None, RoundingPoint(quantizer, "compressed_kv", self.layer_id, entry_ids)
            )
            keys = self.indexer.keys(latents, cos, sin, quantizer, self.layer_id, entry_ids)
            keep = kept_entries(span.start // self.compress_ratio, span.reuse_below, self.compress_ratio)
            cache.write_entries(self.layer_id, block_table, entry_ids[keep], entries[keep], keys[keep])
        count = (span.start + span.length) // self.compress_ratio
        state.source = SourceEntries(*cache.read_entries(self.layer_id, block_table, count))


def _joined(stack: JoinedLinears | None, x: torch.Tensor, names: tuple[str, ...] | None) -> dict[str, torch.Tensor]:
    """The stack's outputs by name (all groups, or the run of groups covering ``names``); none without a stack."""
    return stack(x, names) if stack is not None else {}
