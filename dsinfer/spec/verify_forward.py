"""The target's verify forward over fixed-width spans, driven by device tensors alone (what a CUDA graph replays).

A verify step runs every sequence's last token and its drafts: ``width`` = K + 1 positions per sequence, the
same for all of them (:class:`FixedWidthBatch`). The forward runs everything that is per token (embedding,
projections, mHC, MoE, Engram, the head) once over all ``B * width`` rows, and the attention column by column:
column ``j`` holds position ``start + j`` of every sequence and runs through the attention's own decode path
(ring write, compressors, indexer, the decode op), so each position sees the ring and the unfinished windows
exactly as a plain decode step of that position would. No shape depends on a device value and no metadata is
built on the host, so the whole forward can be captured once per batch bucket and replayed.

Rollback (:mod:`dsinfer.spec.rollback`) needs what every compressor's unfinished window held before the step and
what each column added to it: :class:`PendingJournal` gathers both into one padded tensor per compressor, the
records of a :class:`~dsinfer.spec.rollback.PaddedJournal` (the eager path's per-span journal at fixed width).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsinfer.kv.batch import DeviceSpans, PackedBatch, SequenceSpan
from dsinfer.kv.cache_v4 import KVCache
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.layers.attention import decode_window_positions
from dsinfer.layers.rotary import apply_rope, normalize_and_rope, rope_and_round, rope_angles
from dsinfer.ops.index_scores import top_k_in_order


@dataclass
class FixedWidthBatch:
    """``B`` sequences of exactly ``width`` new positions each (consecutive from ``starts``), as device tensors.

    Rows past the real sequences are padding: the spare slot, start 0, block tables of the trash block only,
    so they touch nothing a sequence owns. ``row_slots`` gives each position its own slot (a drafter runs a
    sequence's rejected positions in the spare slot); None: every position in its sequence's slot."""

    input_ids: torch.Tensor  # [B, width]
    starts: torch.Tensor  # [B] position of each sequence's first new token
    slots: torch.Tensor  # [B]
    window_from: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, table_width], padded with the trash block
    cache: KVCache | KVCacheV41
    spare_slot: int
    row_slots: torch.Tensor | None = None  # [B, width]
    positions: torch.Tensor = field(init=False)  # [B, width]
    # Each column contiguous, as kernels read their index tensors: [width, B].
    column_positions: torch.Tensor = field(init=False)
    column_ids: torch.Tensor = field(init=False)
    column_slots: torch.Tensor | None = field(init=False)

    def __post_init__(self) -> None:
        self.positions = self.starts[:, None] + torch.arange(self.width, device=self.starts.device)
        self.column_positions = self.positions.t().contiguous()
        self.column_ids = self.input_ids.t().contiguous()
        self.column_slots = None if self.row_slots is None else self.row_slots.t().contiguous()

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def width(self) -> int:
        return int(self.input_ids.shape[1])

    def packed(self) -> PackedBatch:
        """The whole batch as a packed batch (sequence after sequence) with its device spans; the host spans say
        only the lengths, which is all the model's per-token code reads of them."""
        size, width = self.size, self.width
        spans = [SequenceSpan(0, width, self.spare_slot, []) for _ in range(size)]
        batch = PackedBatch(self.input_ids.flatten(), self.positions.flatten(), spans, self.cache)
        last_rows = torch.arange(size, device=self.starts.device) * width + width - 1
        batch._device_spans = DeviceSpans(self.slots, self.starts, self.window_from, self.block_tables, last_rows)
        return batch

    def column(self, index: int) -> PackedBatch:
        """Column ``index`` (position ``start + index`` of every sequence) as a decode-shaped batch."""
        slots = self.slots if self.column_slots is None else self.column_slots[index]
        return self.decode_batch(self.column_positions[index], self.column_ids[index], slots)

    def decode_batch(
        self, positions: torch.Tensor, input_ids: torch.Tensor, slots: torch.Tensor | None = None
    ) -> PackedBatch:
        """A decode-shaped batch of the same sequences: one position each (``positions`` [B]), in ``slots``
        (default: their own)."""
        spans = [SequenceSpan(0, 1, self.spare_slot, []) for _ in range(self.size)]
        batch = PackedBatch(input_ids, positions, spans, self.cache)
        rows = torch.arange(self.size, device=positions.device)
        slots = self.slots if slots is None else slots
        batch._device_spans = DeviceSpans(slots, positions, self.window_from, self.block_tables, rows)
        return batch

    def columns(self, rows: torch.Tensor) -> torch.Tensor:
        """A per-row tensor [B * width, ...] as [width, B, ...]: column ``j`` contiguous."""
        return rows.view(self.size, self.width, *rows.shape[1:]).transpose(0, 1).contiguous()

    def rows(self, columns: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`columns`: [width, B, ...] back to [B * width, ...], sequence after sequence."""
        return columns.transpose(0, 1).reshape(-1, *columns.shape[2:])


class PendingJournal:
    """Each compressor's unfinished window before the step and every column's addition to it, joined per sequence
    into the record rollback reads: positions from the first of the window the span starts in through its end."""

    def __init__(self, batch: FixedWidthBatch) -> None:
        self.batch = batch
        self.records: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def before(self, states: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The unfinished windows of the batch's slots [B, ratio, width] (before the layer's columns run)."""
        slots = self.batch.slots
        return [(state.pending_values[slots], state.pending_gates[slots]) for state in states]

    def column(self, states: list, column: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """What column ``column`` wrote into each unfinished window [B, width] (its position's row)."""
        slots, positions = self.batch.slots, self.batch.column_positions[column]
        rows = []
        for state in states:
            offsets = positions % state.ratio
            rows.append((state.pending_values[slots, offsets], state.pending_gates[slots, offsets]))
        return rows

    def close(self, states: list, before: list, written: list[list]) -> None:
        """Join each state's window before the step with the columns' rows [B, ratio - 1 + width, width]."""
        batch = self.batch
        for index, state in enumerate(states):
            ratio = state.ratio
            offset = (batch.starts % ratio)[:, None]  # rows of the window before the span's first position
            length = ratio - 1 + batch.width
            place = torch.arange(length, device=offset.device)[None, :]
            source = torch.where(place < offset, place, ratio + place - offset).clamp(max=ratio + batch.width - 1)
            joined = []
            for part in range(2):
                columns = torch.stack([rows[index][part] for rows in written], dim=1)
                both = torch.cat([before[index][part], columns], dim=1)
                joined.append(both.gather(1, source[..., None].expand(-1, -1, both.shape[-1])))
            self.records[id(state)] = (joined[0], joined[1])


# ---- V4 ----------------------------------------------------------------------------------------------------
def verify_streams_v4(model, batch: FixedWidthBatch, journal: PendingJournal) -> torch.Tensor:
    """V4's residual streams [B * width, hc, hidden] after every block (what ``hidden_streams`` returns)."""
    packed = batch.packed()
    streams = model.copy_into_streams(model.embed(packed.input_ids))
    for layer in model.layers:
        inv_freq = model.rope.for_ratio(layer.attn.compress_ratio)

        def attention(x: torch.Tensor, layer=layer, inv_freq=inv_freq) -> torch.Tensor:
            return attention_by_columns(layer.attn, layer.layer_id, x, batch, inv_freq, journal)

        def feed_forward(x: torch.Tensor, layer=layer) -> torch.Tensor:
            return layer.ffn(x, packed.input_ids)

        streams = layer.run_sites(streams, attention, feed_forward)[0]
    return streams


def attention_by_columns(
    attn, layer_id: int, x: torch.Tensor, batch: FixedWidthBatch, inv_freq, journal: PendingJournal | None
) -> torch.Tensor:
    """A V4 attention (``Attention``, or an MTP layer's) over every row [B * width, hidden]: the projections over
    all rows (as ``Attention.forward``), the attention itself through ``Attention._attend_decode`` one column at
    a time. ``journal`` records the compressors' unfinished windows (None: a window-only layer)."""
    layer_cache = batch.cache.layers[layer_id]
    cos, sin = rope_angles(batch.positions.flatten(), inv_freq)
    q_latent = attn.q_norm(attn.wq_a(x))
    q = attn.wq_b(q_latent).view(-1, attn.n_heads, attn.head_dim)
    q = normalize_and_rope(q, attn.config.rms_norm_eps, cos, sin, attn.ops)  # the chains of Attention.forward
    kv = rope_and_round(attn.wkv(x), cos, sin, attn.ops, attn.kv_norm)
    states = [state for state in (layer_cache.compressor, layer_cache.indexer) if state is not None]
    if states and journal is None:
        raise ValueError("a compressed layer's fixed-width forward needs a journal (the rollback reads it)")
    before = journal.before(states) if states else []
    written, outputs = [], []
    xs, qs, latents, kvs = (batch.columns(t) for t in (x, q, q_latent, kv))
    for j in range(batch.width):
        outputs.append(attn._attend_decode(xs[j], qs[j], latents[j], kvs[j], batch.column(j), layer_cache, inv_freq))
        if states:
            written.append(journal.column(states, j))
    if states:
        journal.close(states, before, written)
    out = apply_rope(batch.rows(torch.stack(outputs)), cos, sin, inverse=True, ops=attn.ops)
    return attn._project_out(out)


# ---- V4.1 --------------------------------------------------------------------------------------------------
def verify_layers_v41(model, batch: FixedWidthBatch, journal: PendingJournal, capture: bool = False):
    """V4.1's streams, final mix and forward context (``run_layers``), with DSpark's target hiddens when
    ``capture``. Each column keeps its own dict of what the KV and index sources publish to later layers."""
    packed = batch.packed()
    ctx = model.context(packed, capture)  # Engram rows over the whole span (and each slot's history advanced)
    streams, pre_mix = model.embed_streams(packed.input_ids)
    published = [{} for _ in range(batch.width)]
    for layer in model.layers:
        streams = layer.with_engram(streams, ctx)
        if layer.layer_id in ctx.captured:
            ctx.captured[layer.layer_id] = streams.float().mean(dim=-2).to(streams.dtype)
        inv_freq = ctx.rope.for_ratio(layer.attn.compress_ratio)

        def attention(x: torch.Tensor, layer=layer, inv_freq=inv_freq) -> torch.Tensor:
            return _attention_v41(layer.attn, x, batch, inv_freq, published, ctx.quantizer, journal)

        def feed_forward(x: torch.Tensor, layer=layer) -> torch.Tensor:
            return layer.ffn(x, ctx.image_mask)

        streams, pre_mix = layer.run_sites(streams, attention, feed_forward, carried_mix=pre_mix)
    return streams, pre_mix, ctx


def _attention_v41(attn, x, batch: FixedWidthBatch, inv_freq, published, quantizer, journal: PendingJournal):
    """V4.1 attention of every row: projections over all rows, then per column what ``_forward_decode`` does
    between its projections and its output (window ring, the sources' publishing, the index sources' choice)."""
    cache: KVCacheV41 = batch.cache
    cache.check_fake_quantization(quantizer.enabled)
    cos, sin, q_latent, q, kv = attn._queries_and_kv(x, batch.positions.flatten(), inv_freq, quantizer)
    source = cache.layers[attn.layer_id].source
    states = [source] if source is not None and source.pending_values is not None else []
    before, written, outputs = journal.before(states), [], []
    xs, qs, latents, kvs = (batch.columns(t) for t in (x, q, q_latent, kv))
    for j in range(batch.width):
        outputs.append(_attend_column_v41(attn, xs[j], qs[j], latents[j], kvs[j], batch.column(j), inv_freq,
                                          published[j], quantizer))  # fmt: skip
        written.append(journal.column(states, j))
    journal.close(states, before, written)
    out = apply_rope(batch.rows(torch.stack(outputs)), cos, sin, inverse=True, ops=attn.ops)
    return attn._project_out(out)


def _attend_column_v41(attn, x, q, q_latent, kv, column: PackedBatch, inv_freq, state: dict, quantizer):
    """One column's attention [B, H, D], as ``AttentionV41._forward_decode`` computes it for a decode step."""
    cache: KVCacheV41 = column.cache
    spans, positions = column.device_spans, column.positions
    cache.write_window(attn.layer_id, spans.slots, positions, kv)
    key_positions, visible = decode_window_positions(positions, spans, attn.window)
    keys = cache.read_window(attn.layer_id, spans.slots[:, None], key_positions).to(kv.dtype)
    if attn.compress_ratio:
        if attn.compressor is not None:
            attn._publish_decode(x, column, cache, inv_freq, state, quantizer)
        if attn.indexer is not None:
            scores = attn.indexer.candidate_scores(x, q_latent, positions, state["index_keys"], inv_freq, state,
                                                   quantizer)  # fmt: skip
            state["chosen"], state["real"] = top_k_in_order(scores, attn.indexer.topk)
        chosen = state["chosen"]
        entries = state["entries"].gather(1, chosen[..., None].expand(-1, -1, state["entries"].shape[-1]))
        keys = torch.cat([keys, entries.to(keys.dtype)], dim=1)
        visible = torch.cat([visible, state["real"]], dim=1)
    return attn._attend_batched(q, keys, visible)
