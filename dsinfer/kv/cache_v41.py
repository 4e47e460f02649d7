"""The caches DeepSeek-V4.1 keeps per sequence: owned here, written by the layers through the batch metadata.

V4.1 shares compressed KV across layers (CSA2), so only KV-source layers own compressed memory:

* **Per-sequence state slots** (``num_slots``): every layer's window ring of K=V vectors (indexed by
  ``position % window``, FP8-rounded values when the model's fake quantization is on); each ratio > 1
  source's unfinished group (fp32 projected values and gates of the tokens not yet pooled); the last
  ``max_ngram_size - 1`` compressed token ids for Engram hashing; each DSpark stage's 128-slot key ring.
* **Compressed entries in blocks** (``num_blocks``, shared through block tables like V4): a block covers
  ``block_tokens`` positions and holds, for every KV source, the ``block_tokens / ratio`` compressed KV
  entries (post-RoPE) and index keys those positions produce. Layers between sources read their source's
  entries; nothing else is stored per layer.

**Storage.** By default windows, entries and index keys are kept in the model dtype. With
``quantized_storage=True`` they are kept as what the trained-in rounding made them
(:mod:`dsinfer.kv.codecs`): window KV as FP8 e4m3 codes with a ue8m0 exponent per 32 channels,
compressed entries as packed FP4 e2m1 with an e4m3 scale per 16, index keys as packed FP4 with a ue8m0
exponent per 32; decoding gives back the rounded values bit for bit, so the logits do not change. That
needs the model's fake quantization on (:meth:`KVCacheV41.check_fake_quantization`). Unfinished groups
(fp32), Engram ids and DSpark rings are stored as before. The layers read and write only through
:meth:`~KVCacheV41.write_window`, :meth:`~KVCacheV41.read_window`, :meth:`~KVCacheV41.write_entries` and
:meth:`~KVCacheV41.read_entries`, so both storages share one code path; a decode step's attention reads the ring
and entries in place through :meth:`~KVCacheV41.attend_decode`, whose op decodes codes as it loads them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsinfer.config import ModelConfigV41
from dsinfer.engram.hashing import ENGRAM_DEAD
from dsinfer.kv.block_table import block_table_tensor
from dsinfer.kv.codecs import COMPRESSED_KV_FORMAT, INDEX_KEY_FORMAT, WINDOW_KV_FORMAT, CacheFormat
from dsinfer.kv.compressor_state import CompressorTensors
from dsinfer.kv.sequence_copy import copy_sequence_state
from dsinfer.ops.cache_codec.reference import CacheStoreInputs
from dsinfer.ops.coded_attention.reference import CodedDecodeInputs
from dsinfer.ops.registry import OpTable, resolve
from dsinfer.ops.rope_round import RowChain
from dsinfer.ops.sparse_attention.reference import SparseDecodeInputs, StepRows

if TYPE_CHECKING:
    from dsinfer.kv.batch import PackedBatch
    from dsinfer.kv.fixed_width import FixedWidthBatch

DEFAULT_BLOCK_TOKENS = 128  # ratio-1 and ratio-2 index keys fill the FP4 MMA scorer's 64-slot tiles (hopper_words_fits)


@dataclass
class SourceCache:
    """State of one KV source layer's compressor across all slots and blocks."""

    ratio: int
    pending_values: torch.Tensor | None  # [slots, ratio, head_dim] fp32 (ratio > 1 only)
    pending_gates: torch.Tensor | None  # [slots, ratio, head_dim] fp32
    entries: torch.Tensor  # [blocks, block_tokens // ratio, head_dim]; quantized: packed FP4 [..., head_dim / 2]
    index_keys: torch.Tensor  # [blocks, block_tokens // ratio, index_head_dim]; quantized: packed FP4 [..., / 2]
    entry_scales: torch.Tensor | None = None  # quantized only: [blocks, block_tokens // ratio, head_dim / 16] e4m3
    index_key_scales: torch.Tensor | None = None  # quantized only: [..., index_head_dim / 32] ue8m0 bytes


@dataclass
class LayerCacheV41:
    window: torch.Tensor  # [slots, window, head_dim]; quantized: FP8 e4m3 codes
    source: SourceCache | None  # only on KV-source layers
    window_scales: torch.Tensor | None = None  # quantized only: [slots, window, head_dim / 32] ue8m0 bytes


def block_tokens_for_v41(config: ModelConfigV41, requested: int | None = None) -> int:
    """Block size in tokens: a multiple of every source's ratio so entries never straddle blocks."""
    step = math.lcm(*(config.compress_ratios[s] for s in config.kv_source_layer_ids), 1)
    if requested is None:
        return step * math.ceil(DEFAULT_BLOCK_TOKENS / step)
    if requested <= 0 or requested % step:
        raise ValueError(
            f"block_tokens: must be a positive multiple of {step} (the sources' ratios' lcm), got {requested}"
        )
    return requested


class KVCacheV41:
    """All cache tensors of one V4.1 model replica, read and written by the layers through its methods.

    ``quantized_storage`` (keyword, default off) keeps windows, entries and index keys as FP8 / FP4 codes
    plus scales instead of model-dtype values: same numbers, 2 to 4 times fewer bytes (see the module doc).
    """

    def __init__(
        self,
        config: ModelConfigV41,
        num_slots: int,
        num_blocks: int,
        block_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        with_dspark: bool = False,
        *,
        quantized_storage: bool = False,
    ) -> None:
        block_tokens = block_tokens_for_v41(config, block_tokens)
        self.config, self.num_slots, self.num_blocks, self.block_tokens = config, num_slots, num_blocks, block_tokens
        self.dtype, self.element_bytes = dtype, torch.finfo(dtype).bits // 8
        # The cache codecs' backends, chosen once like the model's (none for a cache sized on the meta device).
        self.ops = None if torch.device(device).type == "meta" else resolve(device, dtype)
        self.quantized_storage = bool(quantized_storage)
        self.window_format, self.entry_format, self.index_key_format = self._formats()
        # Every layer's ring is a view of one stack (codes and scales: two), so a fixed-width rollback reaches all of
        # them in one gather.
        rows = (config.num_hidden_layers, num_slots, config.sliding_window)
        self.window_stack, self.window_scale_stack = self._allocate(rows, config.head_dim, self.window_format, device)
        self.layers = [self._layer(i, device) for i in range(config.num_hidden_layers)]
        width = config.engram_max_ngram_size - 1
        self.engram_history = torch.full((num_slots, width), ENGRAM_DEAD, dtype=torch.int64, device=device)
        stages = config.num_nextn_predict_layers if with_dspark else 0
        shape = (num_slots, config.sliding_window, config.head_dim)
        self.dspark_rings = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(stages)]

    def _formats(self) -> tuple[CacheFormat | None, CacheFormat | None, CacheFormat | None]:
        """The storage formats of windows, entries and index keys; None each for model-dtype storage."""
        if not self.quantized_storage:
            return None, None, None
        cfg = self.config
        for fmt, channels, field in (
            (WINDOW_KV_FORMAT, cfg.head_dim, "head_dim"),
            (COMPRESSED_KV_FORMAT, cfg.head_dim, "head_dim"),
            (INDEX_KEY_FORMAT, cfg.index_head_dim, "index_head_dim"),
        ):
            try:
                fmt.check_channels(channels)
            except ValueError as error:
                raise ValueError(f"quantized_storage: the model's {field} does not fit: {error}") from None
        return WINDOW_KV_FORMAT, COMPRESSED_KV_FORMAT, INDEX_KEY_FORMAT

    def _allocate(
        self, rows: tuple[int, ...], channels: int, fmt: CacheFormat | None, device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Zeroed storage for ``rows`` rows of ``channels``: values, or codes and scales."""
        if fmt is None:
            return torch.zeros(*rows, channels, dtype=self.dtype, device=device), None
        codes = torch.zeros(*rows, fmt.code_width(channels), dtype=fmt.code_dtype, device=device)
        return codes, torch.zeros(*rows, fmt.scale_width(channels), dtype=fmt.scale_dtype, device=device)

    def _layer(self, layer_id: int, device) -> LayerCacheV41:
        cfg, slots = self.config, self.num_slots
        window = self.window_stack[layer_id]
        window_scales = None if self.window_scale_stack is None else self.window_scale_stack[layer_id]
        if not cfg.is_kv_source(layer_id):
            return LayerCacheV41(window, None, window_scales)
        ratio = cfg.compress_ratios[layer_id]
        rows = (self.num_blocks + self.spare_blocks, self.block_tokens // ratio)

        def pending() -> torch.Tensor | None:
            if ratio == 1:
                return None
            return torch.zeros(slots, ratio, cfg.head_dim, dtype=torch.float32, device=device)

        entries, entry_scales = self._allocate(rows, cfg.head_dim, self.entry_format, device)
        index_keys, index_key_scales = self._allocate(rows, cfg.index_head_dim, self.index_key_format, device)
        source = SourceCache(ratio, pending(), pending(), entries, index_keys, entry_scales, index_key_scales)
        return LayerCacheV41(window, source, window_scales)

    def ring_stacks(self, num_layers: int) -> list[torch.Tensor]:
        """The rings of the first ``num_layers`` layers as tensors [num_layers, slots, window, ...]: the values, or
        the codes and the scales (each layer's ``window`` and ``window_scales`` are views of them)."""
        stacks = [self.window_stack, self.window_scale_stack]
        return [stack[:num_layers] for stack in stacks if stack is not None]

    spare_blocks = 1  # the trash block, allocated beside the pool: decode steps write unfinished entries there

    @property
    def trash_block(self) -> int:
        """The block past the pool: it pads the step's device block tables (reads clamp it to the pool) and takes a
        decode step's writes of entries whose window is not complete yet (fixed shapes: no host decision)."""
        return self.num_blocks

    def rollback_compressors(self, num_layers: int) -> Iterator[CompressorTensors]:
        """The KV sources of the first ``num_layers`` layers, as rollback reads them: ratio 1 keeps no unfinished
        window; the entries come with the index keys and, in coded storage, their scales."""
        for layer in self.layers[:num_layers]:
            source = layer.source
            if source is None:
                continue
            pending = None if source.pending_values is None else (source.pending_values, source.pending_gates)
            stored = (source.entries, source.index_keys, source.entry_scales, source.index_key_scales)
            yield CompressorTensors(source, source.ratio, pending, None, [t for t in stored if t is not None])

    def slot_tensors(self) -> list[torch.Tensor | None]:
        """Every tensor indexed by state slot: windows (and their scales), the sources' unfinished windows, the
        Engram history and the draft rings."""
        out: list[torch.Tensor | None] = []
        for layer in self.layers:
            out += [layer.window, layer.window_scales]
            if layer.source is not None:
                out += [layer.source.pending_values, layer.source.pending_gates]
        return [*out, self.engram_history, *self.dspark_rings]

    def block_tensors(self) -> list[torch.Tensor | None]:
        """Every tensor indexed by block: the sources' entries and index keys, with their scales when coded."""
        out: list[torch.Tensor | None] = []
        for layer in self.layers:
            source = layer.source
            if source is not None:
                out += [source.entries, source.index_keys, source.entry_scales, source.index_key_scales]
        return out

    def copy_sequence(self, source_slot: int, target_slot: int, source_blocks, target_blocks) -> None:
        """Copy one sequence's state onto another slot and other blocks (:mod:`dsinfer.kv.sequence_copy`)."""
        copy_sequence_state(self, source_slot, target_slot, source_blocks, target_blocks)

    # ---- what the layers call ----------------------------------------------------------------------
    def check_fake_quantization(self, enabled: bool) -> None:
        """Refuse quantized storage under a model whose trained-in rounding is off (its values have no codes)."""
        if self.quantized_storage and not enabled:
            raise ValueError(
                "quantized_storage: this cache keeps window KV, compressed KV and index keys as FP8 / FP4 codes, "
                "which hold them exactly only when the model's fake quantization is on; turn it on or build the "
                "cache with quantized_storage=False"
            )

    def write_window(self, layer_id: int, slot: int, positions: torch.Tensor, kv: torch.Tensor | RowChain) -> None:
        """Store the K=V rows ``kv [n, head_dim]`` of ``positions`` in the slot's ring (row ``position % window``);
        ``kv`` a :class:`RowChain`: the rows its chain gives, computed by the write."""
        layer = self.layers[layer_id]
        self._write(layer.window, layer.window_scales, self.window_format, (slot, positions), kv,
                    self.config.sliding_window)  # fmt: skip

    def read_window(self, layer_id: int, slot: int, positions: torch.Tensor) -> torch.Tensor:
        """The K=V rows ``[n, head_dim]`` (cache dtype) of ``positions``, which must still be in the slot's ring."""
        layer = self.layers[layer_id]
        index = (slot, positions % self.config.sliding_window)
        return self._read(layer.window, layer.window_scales, self.window_format, index)

    def write_entries(
        self,
        layer_id: int,
        block_table: list[int] | torch.Tensor,
        entry_ids: torch.Tensor,
        entries: torch.Tensor,
        keys: torch.Tensor,
    ) -> None:
        """Store a KV source's new entries ``[g, head_dim]`` and index keys by their index in the sequence."""
        if not entry_ids.numel():
            return
        source = self._source(layer_id)
        index = self._entry_location(source, block_table, entry_ids)
        self._write(source.entries, source.entry_scales, self.entry_format, index, entries)
        self._write(source.index_keys, source.index_key_scales, self.index_key_format, index, keys)

    def read_entries(
        self, layer_id: int, block_table: list[int] | torch.Tensor, count: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's first ``count`` entries ``[count, head_dim]`` and index keys (cache dtype) of a KV source."""
        source = self._source(layer_id)
        device = source.entries.device
        index = self._entry_location(source, block_table, torch.arange(count, device=device))
        entries = self._read(source.entries, source.entry_scales, self.entry_format, index)
        return entries, self._read(source.index_keys, source.index_key_scales, self.index_key_format, index)

    def write_entries_at(
        self,
        layer_id: int,
        blocks: torch.Tensor,
        rows: torch.Tensor,
        entries: torch.Tensor | RowChain,
        keys: torch.Tensor | RowChain,
    ) -> None:
        """Store entries ``[n, head_dim]`` and index keys of a KV source at (block, row) pairs (a decode step's;
        either may be a :class:`RowChain` the write computes)."""
        source = self._source(layer_id)
        self._write(source.entries, source.entry_scales, self.entry_format, (blocks, rows), entries)
        self._write(source.index_keys, source.index_key_scales, self.index_key_format, (blocks, rows), keys)

    def index_key_pool(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A KV source's index keys as stored, ``[blocks, per_block, ...]``, and their scales (None: model dtype):
        what a decode step's scores read in place through the block tables."""
        source = self._source(layer_id)
        return source.index_keys, source.index_key_scales

    def attend_decode(
        self,
        ops: OpTable,
        layer_id: int,
        entries_layer: int | None,
        q: torch.Tensor,
        batch: PackedBatch,
        indices: torch.Tensor | None,
        sink: torch.Tensor,
        softmax_scale: float,
    ) -> torch.Tensor:
        """A decode step's attention [B, H, D] over layer ``layer_id``'s window ring and the entries ``indices``
        [B, K] (-1: none) of KV source ``entries_layer`` (None: window only), read where they are stored.

        Model-dtype storage runs V4's ``sparse_attention_decode`` on the ring and the entry pool; coded storage
        runs ``sparse_attention_decode_coded``, which decodes the FP8 ring rows and FP4 entries it reads. Both
        take this step's row already written (:meth:`write_window`); ``batch`` gives the step's positions and
        device spans (slots, window starts, block tables)."""
        layer, spans = self.layers[layer_id], batch.device_spans
        ring = (layer.window, layer.window_scales, spans.slots, None)
        return self._attend(ops, ring, entries_layer, q, batch, indices, sink, softmax_scale)

    def attend_verify(
        self,
        ops: OpTable,
        layer_id: int,
        chosen: tuple[torch.Tensor | None, int | None],
        q: torch.Tensor,
        batch: FixedWidthBatch,
        kv: torch.Tensor,
        sink: torch.Tensor,
        softmax_scale: float,
    ) -> torch.Tensor:
        """Every row of a verify step at once ([B * width], in the packed order, as ``batch.all_rows()``), each over
        the window of its own position and its chosen entries (``chosen``: the entries ``indices`` and the KV source
        ``entries_layer`` they number, as :meth:`attend_decode` takes them), then the step's window rows ``kv``
        [B * width, D] (rounded) to the layer's ring.

        The ring still holds the window before the step while the decode op reads it; the step's own positions come
        from the step's rows (:class:`StepRows`), in coded storage encoded as the ring encodes them, so every query
        reads the values a decode step at its position would."""
        indices, entries_layer = chosen
        rows, origin, layer = batch.all_rows(), batch.step_origin(), self.layers[layer_id]
        step_rows, step_scales = kv, None
        if self.quantized_storage:  # one encoding of the step's rows, into rows of their own
            step_rows = layer.window.new_empty(kv.shape[0], 1, kv.shape[-1])
            step_scales = layer.window_scales.new_empty(kv.shape[0], 1, layer.window_scales.shape[-1])
            token_rows = rows.device_spans.token_rows  # row i goes to slot i, ring row 0 (a one-row ring)
            self._write(step_rows, step_scales, self.window_format, (token_rows, token_rows), kv, 1)
            step_rows, step_scales = step_rows[:, 0], step_scales[:, 0]
        step = StepRows(step_rows, origin.starts, origin.first_rows, step_scales)
        ring = (layer.window, layer.window_scales, rows.device_spans.slots, step)
        out = self._attend(ops, ring, entries_layer, q, rows, indices, sink, softmax_scale)
        self.write_window(layer_id, rows.device_spans.slots, rows.positions, kv)
        return out

    def _attend(self, ops, ring: tuple, entries_layer, q, batch: PackedBatch, indices, sink, softmax_scale):
        """The decode op over ``ring`` (rows, scales, each query's slot, and a verify step's :class:`StepRows` or
        None) and the chosen entries of ``entries_layer`` (see :meth:`attend_decode`)."""
        data, scales, ring_slots, step = ring
        positions, spans = batch.positions, batch.device_spans
        source = None if entries_layer is None or indices is None else self._source(entries_layer)
        tables = spans.block_tables
        if not self.quantized_storage:
            entries = None if source is None else source.entries
            return ops.sparse_attention_decode(
                SparseDecodeInputs(
                    q, data, ring_slots, positions, spans.window_from, entries, tables, indices, sink, softmax_scale,
                    step=step,
                )
            )  # fmt: skip
        entry_codes = None if source is None else source.entries
        entry_scales = None if source is None else source.entry_scales
        return ops.sparse_attention_decode_coded(
            CodedDecodeInputs(
                q, data, scales, ring_slots, positions, spans.window_from, entry_codes, entry_scales, tables,
                None if source is None else indices, sink, softmax_scale, step,
            ),
        )  # fmt: skip

    def _source(self, layer_id: int) -> SourceCache:
        source = self.layers[layer_id].source
        if source is None:
            raise ValueError(f"layer {layer_id} is not a KV source: it owns no compressed entries")
        return source

    def _entry_location(
        self, source: SourceCache, block_table: list[int] | torch.Tensor, entry_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, row) of each entry: entries fill a sequence's blocks in order, ``block_tokens / ratio`` each."""
        per_block = self.block_tokens // source.ratio
        table = block_table_tensor(block_table, entry_ids.device)
        return table[entry_ids // per_block], entry_ids % per_block

    def _write(
        self,
        data: torch.Tensor,
        scales: torch.Tensor | None,
        fmt: CacheFormat | None,
        index: tuple,
        rows: torch.Tensor | RowChain,
        modulus: int | None = None,
    ) -> None:
        """Rows to ``data[index]`` (the second index modulo ``modulus`` when given), encoded in coded storage: one
        ``cache_store`` op (the encoding, the index arithmetic and the scatters of codes and scales together).
        ``rows`` a :class:`RowChain` (a decode step's rows not computed yet): the chain and the store as one op."""
        first, second = index
        if not isinstance(first, torch.Tensor):
            first = torch.full_like(second, first)  # a sequence's slot: a device scalar would need a host copy
        if fmt is None:
            pool = (data, None, first, second, modulus, None, 0, None)
        else:
            fmt.check_channels(rows.shape[-1])
            pool = (data, scales, first, second, modulus, fmt.element, fmt.block, fmt.scale)
        if isinstance(rows, RowChain):
            rows.store(*pool)
        else:
            self.ops.cache_store(CacheStoreInputs(rows, *pool))

    def _read(
        self, data: torch.Tensor, scales: torch.Tensor | None, fmt: CacheFormat | None, index: tuple
    ) -> torch.Tensor:
        if fmt is None:
            return data[index]
        codes = data.view(torch.uint8)[index].view(data.dtype)
        return fmt.decode(codes, scales.view(torch.uint8)[index].view(scales.dtype), self.dtype, self.ops)

    # ---- accounting ------------------------------------------------------------------------------
    def _row_bytes(self, fmt: CacheFormat | None, channels: int) -> int:
        return channels * self.element_bytes if fmt is None else fmt.row_bytes(channels)

    def slot_bytes(self) -> int:
        """Bytes one state slot costs: windows, unfinished groups, Engram ids, DSpark rings."""
        cfg, total = self.config, 0
        for layer in self.layers:
            total += cfg.sliding_window * self._row_bytes(self.window_format, cfg.head_dim)
            if layer.source is not None and layer.source.pending_values is not None:
                total += 2 * layer.source.ratio * cfg.head_dim * 4
        total += (cfg.engram_max_ngram_size - 1) * 8
        total += len(self.dspark_rings) * cfg.sliding_window * cfg.head_dim * self.element_bytes
        return total

    def block_bytes(self) -> int:
        """Bytes one block costs: every source's entries and index keys for ``block_tokens`` positions."""
        cfg, total = self.config, 0
        row = self._row_bytes(self.entry_format, cfg.head_dim) + self._row_bytes(
            self.index_key_format, cfg.index_head_dim
        )
        for layer in self.layers:
            if layer.source is not None:
                total += self.block_tokens // layer.source.ratio * row
        return total

    def bytes_per_token(self) -> float:
        """Compressed-cache bytes per token position (what grows with the context)."""
        return self.block_bytes() / self.block_tokens

    @classmethod
    def scratch(
        cls,
        config: ModelConfigV41,
        seq_lens: list[int],
        dtype: torch.dtype,
        device,
        with_dspark: bool = False,
        *,
        quantized_storage: bool = False,
    ) -> KVCacheV41:
        """A throw-away cache just big enough for whole sequences run from position 0 (no engine)."""
        block_tokens = block_tokens_for_v41(config)
        blocks = sum(math.ceil(n / block_tokens) for n in seq_lens)
        return cls(
            config, len(seq_lens), blocks, block_tokens, dtype, device, with_dspark, quantized_storage=quantized_storage
        )
