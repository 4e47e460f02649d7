"""DeepSeek-V4 attention: shared-KV multi-query attention over a sliding window plus compressed entries.

One 512-d vector per token serves as both key and value. Every query sees the last ``sliding_window``
tokens of its sequence; CSA layers add the compressed entries the indexer selected, HCA layers all
visible compressed entries. A learned per-head sink joins the softmax denominator only. The output's
rope slice is rotated back, then a grouped low-rank projection (``wo_a`` per head group, ``wo_b``)
returns to the hidden size.

The attention itself is an op: ``sparse_attention_decode`` (one token per sequence) and
``sparse_attention_prefill`` (every new token of a packed batch), each with a torch reference and a Triton
backend. The window and compressed entries of earlier tokens come from the cache named by the batch metadata.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.config import ModelConfigBase
from dsinfer.kv.batch import PackedBatch, SequenceSpan, host_to_device
from dsinfer.kv.cache_v4 import LayerCache
from dsinfer.kv.fixed_width import FixedWidthBatch
from dsinfer.layers.compressor import Compressor, visible_entries
from dsinfer.layers.fp8_linear import Fp8Linear
from dsinfer.layers.indexer import Indexer
from dsinfer.layers.joined_linear import JoinedLinears
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.op_binding import reference_ops
from dsinfer.layers.rotary import apply_rope, normalize_and_rope, rope_and_round, step_rope_angles
from dsinfer.ops.cache_codec.reference import CacheStoreInputs
from dsinfer.ops.grouped_linear import grouped_linear
from dsinfer.ops.registry import OpTable
from dsinfer.ops.rope_round import RowChain
from dsinfer.ops.side_stream import beside
from dsinfer.ops.sparse_attention.prefill_reference import (
    SinkAttention,
    SparsePrefillInputs,
    attend_keys,
    attend_window_and_entries,
    sink_softmax,
)
from dsinfer.ops.sparse_attention.reference import SparseDecodeInputs, StepRows

__all__ = ["Attention", "sink_softmax", "window_keys"]


def window_keys(
    kv: torch.Tensor,
    positions: torch.Tensor,
    span: SequenceSpan,
    window: int,
    read_rows: Callable[[torch.Tensor], torch.Tensor],
    write_rows: Callable[[torch.Tensor, torch.Tensor], None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's window keys: cached ones from its ring (``read_rows(positions)``), then the new ones.

    The newest ``window`` of the new rows go back to the ring (``write_rows(positions, rows)``). The ring's
    storage (plain tensor, FP8 codes) is the caller's; the window rule is this one.
    """
    first_cached = max(span.window_from, span.start - window + 1)
    cached_positions = torch.arange(first_cached, span.start, device=kv.device)
    keys = torch.cat([read_rows(cached_positions).to(kv.dtype), kv])
    key_positions = torch.cat([cached_positions, positions])
    recent = slice(max(0, kv.shape[0] - window), None)
    write_rows(positions[recent], kv[recent])
    return keys, key_positions


class Attention(nn.Module):
    """V4's attention; its projections, norms and sinks are what V4.1's and the DSpark stages' build on (they pass
    ``compress_ratio`` 0 and add their own compressed part)."""

    def __init__(self, config: ModelConfigBase, compress_ratio: int) -> None:
        super().__init__()
        self.compress_ratio = compress_ratio
        self._build_projections(config)
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if compress_ratio:
            overlap = compress_ratio == config.csa_ratio
            self.compressor = Compressor(
                config.hidden_size, self.head_dim, compress_ratio, overlap, config.rms_norm_eps
            )
            if overlap:
                self.indexer = Indexer(config)

    def _build_projections(self, config: ModelConfigBase) -> None:
        """The projections, norms and sinks every shared-KV attention has (V4, V4.1 and its DSpark stages)."""
        self.config = config
        self.n_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.window = config.sliding_window
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
        self.ops: OpTable = reference_ops()  # the model binds its table when it is built
        # Inference (join_projections): the projections of the layer input, and of the low-rank query, stacked.
        self.joined_inputs: JoinedLinears | None = None
        self.joined_queries: JoinedLinears | None = None

    def join_projections(self) -> None:
        """Inference: every projection of the layer input in one GEMM, every projection of the low-rank query in
        another (see ``JoinedLinears``); the parameters become views of the stacks' rows, names unchanged.

        Input rows, in order: ``q_a`` (``wq_a``), ``kv`` (``wkv``), ``compressor`` (its ``wkv`` then ``wgate``),
        and with V4's indexer ``index_compressor`` (likewise) and ``index_weights`` (``weights_proj``); query rows:
        ``q`` (``wq_b``), ``index_q`` (the indexer's ``wq_b``). Projections of another kind or dtype (FP8 kept as
        stored, a compressor pooling in fp32) stay on their own. The compressors' ``joined_projection`` becomes
        the view of their rows, so their own ``join_projections`` (after this one: parents first) keeps it."""
        compressor = getattr(self, "compressor", None)
        indexer = getattr(self, "indexer", None)
        indexer = indexer if isinstance(indexer, Indexer) else None  # V4.1's scorers project on their own
        groups: dict[str, tuple[nn.Module, ...]] = {"q_a": (self.wq_a,), "kv": (self.wkv,)}
        if compressor is not None and compressor.joins_with_input:
            groups["compressor"] = (compressor.wkv, compressor.wgate)
        if indexer is not None:
            if indexer.compressor.joins_with_input:
                groups["index_compressor"] = (indexer.compressor.wkv, indexer.compressor.wgate)
            groups["index_weights"] = (indexer.weights_proj,)
        self.joined_inputs = JoinedLinears.join(groups, self.joined_inputs)
        for name, owner in (("compressor", compressor), ("index_compressor", indexer and indexer.compressor)):
            if self.joined_inputs is not None and name in self.joined_inputs.groups:
                owner.joined_projection = self.joined_inputs.group_weight(name)
        queries = {"q": (self.wq_b,), "index_q": (indexer.wq_b,)} if indexer is not None else {}
        self.joined_queries = JoinedLinears.join(queries, self.joined_queries)

    def _input_projections(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The layer input's projections by name (see :meth:`join_projections`): ``q_a`` and ``kv`` always, the
        compressors' and indexer's when joined (else their modules project on their own)."""
        projected = self.joined_inputs(x) if self.joined_inputs is not None else {}
        if "q_a" not in projected:
            projected["q_a"] = self.wq_a(x)
        if "kv" not in projected:
            projected["kv"] = self.wkv(x)
        return projected

    def _query_projections(self, q_latent: torch.Tensor) -> dict[str, torch.Tensor]:
        """The low-rank query's projections: ``q`` [T, heads * head_dim] always, ``index_q`` when joined."""
        projected = self.joined_queries(q_latent) if self.joined_queries is not None else {}
        if "q" not in projected:
            projected["q"] = self.wq_b(q_latent)
        return projected

    def _queries(self, projected: dict[str, torch.Tensor], cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed, RoPE'd queries [T, H, D] and the low-rank query from ``projected``'s ``q_a``; the query
        GEMMs' other outputs (``index_q`` when joined) go into ``projected``."""
        q_latent = self.q_norm(projected.pop("q_a"))
        projected.update(self._query_projections(q_latent))
        q = projected.pop("q").view(-1, self.n_heads, self.head_dim)
        return normalize_and_rope(q, self.config.rms_norm_eps, cos, sin, self.ops), q_latent

    def forward(self, x: torch.Tensor, batch: PackedBatch, inv_freq: torch.Tensor, layer_id: int) -> torch.Tensor:
        """x: [T, hidden] packed; ``inv_freq`` is this layer's RoPE (plain or YaRN-scaled). A fixed-width verify
        batch (``batch.fixed_width``) runs :meth:`_forward_columns`."""
        if batch.fixed_width is not None:
            return self._forward_columns(x, batch.fixed_width, inv_freq, layer_id, batch.column_journal)
        layer_cache = batch.cache.layers[layer_id]
        cos, sin = step_rope_angles(batch, inv_freq, ops=self.ops)
        projected = self._input_projections(x)
        kv_row = projected.pop("kv")

        def queries() -> tuple[torch.Tensor, torch.Tensor]:
            return self._queries(projected, cos, sin)

        # The norm and RoPE: one op; at decode the row's only use is the ring's write, which runs it with the store.
        kv = rope_and_round(kv_row, cos, sin, self.ops, self.kv_norm, defer=batch.is_decode)
        if batch.is_decode:
            # The cache writes (the window row, the compressor's entry) read none of the queries' work: at decode on
            # CUDA they run on the side stream beside the query projections (dsinfer.ops.side_stream).
            compressed = projected.pop("compressor", None)
            _, (q, q_latent) = beside(
                lambda: self._write_decode_caches(x, kv, batch, layer_cache, inv_freq, compressed), queries, x
            )
            out = self._select_and_attend(x, q, q_latent, batch, layer_cache, inv_freq, projected)
        else:
            q, q_latent = queries()
            out = self._attend_prefill(x, q, q_latent, kv, batch, layer_cache, inv_freq, projected)
        out = apply_rope(out, cos, sin, inverse=True, ops=self.ops, in_place=True)  # fresh tensors: rope in place
        return self._project_out(out)

    def _forward_columns(
        self, x: torch.Tensor, batch: FixedWidthBatch, inv_freq: torch.Tensor, layer_id: int, journal
    ) -> torch.Tensor:
        """Every row of a fixed-width batch [B * width, hidden] (the packed order): the projections over all rows;
        the compressors' updates column by column (position order, recorded in ``journal``, a
        :class:`PendingJournal`; None: a window-only layer); then the indexer's choice and the attention of every
        row at once (:meth:`_attend_all_rows`). A batch whose columns run in slots of their own (``row_slots``: a
        drafter's rejected positions) attends column by column instead."""
        layer_cache = batch.cache.layers[layer_id]
        rows = batch.all_rows()
        cos, sin = step_rope_angles(rows, inv_freq, ops=self.ops)  # once per forward, shared by the layers
        projected = self._input_projections(x)  # every row at once, as a decode step's rows: one joined GEMM
        q, q_latent = self._queries(projected, cos, sin)
        kv = rope_and_round(projected.pop("kv"), cos, sin, self.ops, self.kv_norm)
        states = [state for state in (layer_cache.compressor, layer_cache.indexer) if state is not None]
        if states and journal is None:
            raise ValueError("a compressed layer's fixed-width forward needs a journal (the rollback reads it)")
        if batch.row_slots is not None:
            step = (x, q, q_latent, kv)
            out = batch.rows(self._attend_column_by_column(step, batch, layer_cache, inv_freq, projected,
                                                           (journal, states)))  # fmt: skip
        else:
            if states:
                self._update_compressors_by_column(x, batch, layer_cache, inv_freq, projected, (journal, states))
            out = self._attend_all_rows(x, q, q_latent, kv, batch, layer_cache, inv_freq, projected)
        out = apply_rope(out, cos, sin, inverse=True, ops=self.ops, in_place=True)  # fresh tensors: rope in place
        return self._project_out(out)

    def _update_compressors_by_column(self, x, batch: FixedWidthBatch, layer_cache, inv_freq, projected, journaled):
        """Every column's compressor updates (the attention's and the indexer's keys), in position order, each as a
        decode step makes them, recorded in the journal (``journaled``: the journal and the states it records)."""
        journal, states = journaled
        xs = batch.columns(x)
        names = ("compressor", "index_compressor")
        by_column = {name: batch.columns(projected[name]) for name in names if name in projected}
        journal.run_columns(states, lambda j: self._update_compressors(
            xs[j], batch.column(j), layer_cache, inv_freq, {n: t[j] for n, t in by_column.items()}))  # fmt: skip

    def _attend_column_by_column(self, step: tuple, batch: FixedWidthBatch, layer_cache, inv_freq, projected,
                                 journaled) -> torch.Tensor:  # fmt: skip
        """A drafter's batch (``row_slots``): each column of ``step`` (its rows' ``x``, queries, low-rank queries
        and window rows) through the decode path in its own slots, recorded in the journal (``journaled``: the
        journal and the states it records; none in a window-only layer). Returns [width, B, H, D]."""
        journal, states = journaled
        xs, qs, latents, kvs = (batch.columns(t) for t in step)
        by_column = {name: batch.columns(t) for name, t in projected.items()}

        def attend(j: int) -> torch.Tensor:
            column_projected = {name: t[j] for name, t in by_column.items()}
            return self._attend_decode(xs[j], qs[j], latents[j], kvs[j], batch.column(j), layer_cache, inv_freq,
                                       column_projected)  # fmt: skip

        outputs = journal.run_columns(states, attend) if journal is not None else list(map(attend, range(batch.width)))
        return torch.stack(outputs)

    def _update_compressors(self, x, column: PackedBatch, layer_cache: LayerCache, inv_freq, projected) -> None:
        """One column's compressor updates (the attention's and the indexer's keys), as a decode step makes them."""
        if self.compressor is not None:
            self.compressor.update_decode(x, column, layer_cache.compressor, inv_freq, projected.get("compressor"))
        if self.indexer is not None:
            keys = self.indexer.compressor
            keys.update_decode(x, column, layer_cache.indexer, inv_freq, projected.get("index_compressor"))

    def _attend_all_rows(self, x, q, q_latent, kv, batch: FixedWidthBatch, layer_cache, inv_freq, projected):
        """Every row's attention in one decode op over the ``B * width`` rows (the packed order), the entries
        already written: each row sees the ``window`` positions up to its own, those before the step from the
        layer's ring and the step's own from ``kv`` (:class:`StepRows`), and the entries its position sees. The
        step's rows go into the ring afterwards."""
        rows = batch.all_rows()
        spans, positions, ring = rows.device_spans, rows.positions, layer_cache.window
        origin = batch.step_origin()
        entries, indices = self._entries_and_indices(x, q_latent, rows, layer_cache, inv_freq, projected, True)
        out = self.ops.sparse_attention_decode(
            SparseDecodeInputs(
                q, ring, spans.slots, positions, spans.window_from, entries, spans.block_tables, indices,
                self.attn_sink, self.softmax_scale, step=StepRows(kv, origin.starts, origin.first_rows),
            )
        )  # fmt: skip
        self.ops.cache_store(CacheStoreInputs(kv, ring, None, spans.slots, positions, self.window, None, 0, None))
        return out

    def _attend_decode(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        q_latent: torch.Tensor,
        kv: torch.Tensor | RowChain,
        batch: PackedBatch,
        layer_cache: LayerCache,
        inv_freq: torch.Tensor,
        projected: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One token per sequence, every sequence at once, driven by the step's device tensors (no host reads).

        Keys are the window (``window`` ring rows, oldest first) and then the compressed entries: the indexer's
        choice in CSA layers, every visible entry in HCA layers; what a sequence may not see is masked.

        ``projected``: the forward's joined projections other than q and kv, by name (see
        :meth:`join_projections`). None (a caller that projected q and kv itself): the compressors' and the
        indexer's rows of the input stack in one GEMM here, when joined.
        """
        if projected is None and self.joined_inputs is not None:
            projected = self.joined_inputs(x, ("compressor", "index_compressor", "index_weights"))
        projected = projected or {}
        self._write_decode_caches(x, kv, batch, layer_cache, inv_freq, projected.get("compressor"))
        return self._select_and_attend(x, q, q_latent, batch, layer_cache, inv_freq, projected)

    def _write_decode_caches(
        self,
        x: torch.Tensor,
        kv: torch.Tensor | RowChain,
        batch: PackedBatch,
        layer_cache: LayerCache,
        inv_freq: torch.Tensor,
        compressed: torch.Tensor | None,
    ) -> None:
        """Decode's cache writes: each sequence's KV row into its window ring, and the compressor's pending window
        (an entry where the token completes one). ``compressed``: the compressor's joined projection of ``x``, if
        the caller's GEMM made it."""
        spans, positions = batch.device_spans, batch.positions
        ring_rows = (layer_cache.window, None, spans.slots, positions, self.window, None, 0, None)  # row pos % window
        if isinstance(kv, RowChain):
            kv.store(*ring_rows)
        else:
            ops = self.ops
            ops.cache_store(CacheStoreInputs(kv, *ring_rows))
        if self.compressor is not None:
            self.compressor.update_decode(x, batch, layer_cache.compressor, inv_freq, compressed)

    def _select_and_attend(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        q_latent: torch.Tensor,
        batch: PackedBatch,
        layer_cache: LayerCache,
        inv_freq: torch.Tensor,
        projected: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """Decode after the cache writes: the indexer's choice (CSA), the visible entries (HCA), the attention."""
        spans, positions = batch.device_spans, batch.positions
        entries, indices = self._entries_and_indices(x, q_latent, batch, layer_cache, inv_freq, projected)
        return self.ops.sparse_attention_decode(
            SparseDecodeInputs(
                q, layer_cache.window, spans.slots, positions, spans.window_from, entries, spans.block_tables, indices,
                self.attn_sink, self.softmax_scale,
            )
        )  # fmt: skip

    def _entries_and_indices(
        self, x, q_latent, batch: PackedBatch, layer_cache, inv_freq, projected, keys_written=False
    ):
        """The compressed entries and each row's chosen entry numbers (-1: none), or (None, None) in a window-only
        layer: the indexer's choice in CSA layers (``keys_written``: its keys are in the cache already), every
        visible entry in HCA layers."""
        if self.compressor is None:
            return None, None
        entries = layer_cache.compressor.entries
        if self.indexer is not None:
            choose = self.indexer.choose_decode if keys_written else self.indexer.select_decode
            chosen, real = choose(x, q_latent, batch, layer_cache.indexer, inv_freq, projected)
        else:
            spans = batch.device_spans
            chosen = torch.arange(spans.max_blocks * entries.shape[1], device=x.device).expand(x.shape[0], -1)
            real = chosen < visible_entries(batch.positions, self.compress_ratio)[:, None]
        return entries, torch.where(real, chosen, -1)

    def _attend_prefill(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        q_latent: torch.Tensor,
        kv: torch.Tensor,
        batch: PackedBatch,
        layer_cache: LayerCache,
        inv_freq: torch.Tensor,
        projected: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Prefill and mixed steps: every new token of the packed batch in one ``sparse_attention_prefill``.

        The compressors (and, CSA, the indexer's choice) run per sequence first; the op reads each sequence's
        window from its new rows and, for positions before the step, its ring, which takes the newest rows after.
        ``projected``: as for :meth:`_attend_decode`, every row of the batch (each sequence takes its rows).
        """
        projected = projected or {}
        spans = batch.device_spans
        tables = spans.block_tables
        entries, indices = None, None
        if self.compressor is not None:
            chosen = []
            for index, (span, tokens) in enumerate(zip(batch.spans, batch.sequence_slices(), strict=True)):
                positions = batch.positions[tokens]
                rows = {name: value[tokens] for name, value in projected.items()}
                self.compressor.update(x[tokens], positions, span, layer_cache.compressor, inv_freq, tables[index],
                                       rows.get("compressor"))  # fmt: skip
                if self.indexer is not None:
                    chosen.append(
                        self.indexer(x[tokens], q_latent[tokens], positions, span, layer_cache.indexer, inv_freq,
                                     tables[index], rows)
                    )  # fmt: skip
            entries = layer_cache.compressor.entries
            if self.indexer is not None:
                width = max(piece.shape[1] for piece in chosen)
                indices = torch.cat([F.pad(piece, (0, width - piece.shape[1]), value=-1) for piece in chosen])
        rows = spans.token_rows
        sequence_rows = torch.cat([rows.new_zeros(1), rows + 1])
        ops = self.ops
        out = ops.sparse_attention_prefill(
            SparsePrefillInputs(
                q, kv, batch.positions, sequence_rows, spans.starts, spans.slots, spans.window_from, layer_cache.window,
                self.window, entries, tables, indices, self.compress_ratio, self.attn_sink, self.softmax_scale,
                [(span.start, span.length, span.window_from) for span in batch.spans],
            ),
        )  # fmt: skip
        self._write_window(kv, batch, layer_cache.window)
        return out

    def _write_window(self, kv: torch.Tensor, batch: PackedBatch, ring: torch.Tensor) -> None:
        """The newest ``window`` new rows of every sequence into its ring (row ``position % ring size``)."""
        rows, slots = [], []
        for span, tokens in zip(batch.spans, batch.sequence_slices(), strict=True):
            recent = range(max(tokens.start, tokens.stop - self.window), tokens.stop)
            rows.extend(recent)
            slots.extend([span.slot] * len(recent))
        rows = host_to_device(rows, torch.long, kv.device)
        slots = host_to_device(slots, torch.long, kv.device)
        ring[slots, batch.positions[rows] % ring.shape[1]] = kv[rows].to(ring.dtype)

    def _attend(
        self,
        q: torch.Tensor,
        positions: torch.Tensor,
        window_kv: torch.Tensor,
        window_positions: torch.Tensor,
        compressed: torch.Tensor | None,
        compressed_visible: torch.Tensor | None,
    ) -> torch.Tensor:
        """Softmax attention of one sequence's queries [n, H, D] over its window and compressed entries."""
        return attend_window_and_entries(
            q, positions, window_kv, window_positions, compressed, compressed_visible,
            SinkAttention(self.window, self.attn_sink, self.softmax_scale),
        )  # fmt: skip

    def _attend_keys(self, q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
        """Queries [n, H, D] of one sequence over shared keys [K, D] (``visible`` [n, K]; None: all of them)."""
        return attend_keys(q, keys, visible, self.attn_sink, self.softmax_scale)

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output projection: each head group through its own slice of ``wo_a``."""
        flat, groups = out.reshape(out.shape[0], -1), self.config.o_groups
        if isinstance(self.wo_a, Fp8Linear):  # FP8 kept as stored: the op reads the codes group by group
            return self.wo_b(self.wo_a(flat, groups=groups))
        return self.wo_b(grouped_linear(flat, self.wo_a.weight, groups))
