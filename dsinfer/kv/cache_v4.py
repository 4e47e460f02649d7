"""The caches DeepSeek-V4 keeps per sequence, owned here and written by the layers through the batch metadata.

Two kinds of memory:

* **Per-sequence state slots** (one per running sequence, ``num_slots`` of them): each layer's 128-token
  window of K=V vectors (a ring indexed by ``position % window``) and each compressor's unfinished window
  (``pending``: projected values and gates of tokens not yet pooled) plus, for overlapping (CSA)
  compressors, the last complete window (its ``Ca`` half feeds the next entry).
* **Compressed entries in blocks** (``num_blocks`` shared, reference-counted by the block manager): a block
  covers ``block_tokens`` token positions and holds, for every compressed layer, the ``block_tokens / ratio``
  entries those positions produce (CSA and HCA KV, indexer keys). A sequence's block table lists its blocks
  in position order; full blocks can be shared between sequences with the same prefix.

**Index-key storage.** The indexer's keys are kept in the model dtype, or (``index_key_format``, the engine's
``kv_cache_dtype: fp8``) as the release keeps them: FP8 e4m3 codes with one ue8m0 exponent byte per 128 channels
(:data:`~dsinfer.kv.codecs.INDEX_KEY_FP8_FORMAT`), half the bytes of bf16. Those keys are rounded, not lossless:
the top-k choice can change where two entries' scores lie within the rounding of each other. Every write goes
through :meth:`CompressorCache.store_rows`, every read through :meth:`CompressorCache.load_rows` or the paged
scoring op, which reads the codes and scales in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dsinfer.config import ModelConfig
from dsinfer.kv.codecs import CacheFormat
from dsinfer.kv.compressor_state import CompressorTensors
from dsinfer.kv.sequence_copy import copy_sequence_state
from dsinfer.ops.registry import OpTable


@dataclass
class CompressorCache:
    """State of one compressor (a layer's main compressor or its indexer's) across all slots and blocks."""

    ratio: int
    dim: int
    overlap: bool
    pending_values: torch.Tensor  # [slots, ratio, width]
    pending_gates: torch.Tensor  # [slots, ratio, width]
    previous_values: torch.Tensor | None  # [slots, ratio, width]: last complete window (overlap only)
    previous_gates: torch.Tensor | None
    entries: torch.Tensor  # [blocks, block_tokens // ratio, dim]; coded: the format's codes
    entry_format: CacheFormat | None = None  # None: entries in the model dtype
    entry_scales: torch.Tensor | None = None  # coded only: [blocks, block_tokens // ratio, dim / block] scales

    def entry_tensors(self) -> list[torch.Tensor]:
        """The tensors indexed by block: the entries and, coded, their scales."""
        return [self.entries] if self.entry_scales is None else [self.entries, self.entry_scales]

    def store_rows(
        self, blocks: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, ops: OpTable | None = None
    ) -> None:
        """``values`` [n, dim] into ``(blocks[i], rows[i])``, encoded when the entries are coded (``ops``: the table
        the layer encodes with; None: the one for the values' device and dtype)."""
        if self.entry_format is None:
            self.entries[blocks, rows] = values.to(self.entries.dtype)
            return
        codes, scales = self.entry_format.encode(values, ops)
        _as_bytes(self.entries)[blocks, rows] = _as_bytes(codes)
        _as_bytes(self.entry_scales)[blocks, rows] = _as_bytes(scales)

    def load_rows(
        self, blocks: torch.Tensor, rows: torch.Tensor, ops: OpTable | None = None, decoded: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """The entries at ``(blocks[i], rows[i])`` [n, dim]: as stored, or decoded to ``decoded``: float32, what the
        scoring ops widen plain keys to, or bfloat16, which holds every e4m3 code times a ue8m0 scale exactly too
        (same exponent range) and meets bf16 queries on the tensor cores (float32 keys take IEEE products)."""
        if self.entry_format is None:
            return self.entries[blocks, rows]
        if decoded not in (torch.float32, torch.bfloat16):
            raise ValueError(f"coded entries decode exactly to float32 or bfloat16, not {decoded}")
        codes = _as_bytes(self.entries)[blocks, rows].view(self.entries.dtype)
        scales = _as_bytes(self.entry_scales)[blocks, rows].view(self.entry_scales.dtype)
        return self.entry_format.decode(codes, scales, decoded, ops)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """One-byte tensors (FP8 codes, scales) through a uint8 view: advanced indexing of float8 is missing on some
    devices and torch versions."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor


@dataclass
class LayerCache:
    window: torch.Tensor  # [slots, window, head_dim]
    compressor: CompressorCache | None
    indexer: CompressorCache | None


def attention_layer_ratios(config: ModelConfig, with_mtp: bool) -> list[int]:
    """Compression ratio of every attention layer that needs a cache (MTP layers are window-only)."""
    extra = config.num_nextn_predict_layers if with_mtp else 0
    return list(config.compress_ratios) + [0] * extra


def block_tokens_for(config: ModelConfig, requested: int | None = None) -> int:
    """Block size in tokens: a multiple of every compression ratio so entries never straddle blocks."""
    step = math.lcm(config.csa_ratio, config.hca_ratio)
    if requested is None:
        return step
    if requested <= 0 or requested % step:
        raise ValueError(f"block_tokens: must be a positive multiple of {step} (the ratios' lcm), got {requested}")
    return requested


@dataclass(frozen=True)
class CacheLayout:
    """Bytes each cache kind costs: per state slot (window + compressor windows) and per block."""

    config: ModelConfig
    ratios: tuple[int, ...]
    block_tokens: int
    element_bytes: int
    index_key_format: CacheFormat | None = None  # None: index keys in the model dtype

    def slot_bytes(self) -> int:
        cfg, total = self.config, 0
        for ratio in self.ratios:
            total += cfg.sliding_window * cfg.head_dim
            if ratio:
                overlap = ratio == cfg.csa_ratio
                width = (2 if overlap else 1) * cfg.head_dim
                total += (4 if overlap else 2) * ratio * width
                if overlap:
                    total += 4 * ratio * 2 * cfg.index_head_dim
        return total * self.element_bytes

    def index_key_bytes(self) -> int:
        """Bytes of one index key: codes and scales, or ``index_head_dim`` values of the model dtype."""
        dim = self.config.index_head_dim
        return dim * self.element_bytes if self.index_key_format is None else self.index_key_format.row_bytes(dim)

    def block_bytes(self) -> int:
        cfg, total = self.config, 0
        for ratio in self.ratios:
            if ratio:
                total += self.block_tokens // ratio * cfg.head_dim * self.element_bytes
                if ratio == cfg.csa_ratio:
                    total += self.block_tokens // ratio * self.index_key_bytes()
        return total

    def bytes_per_token(self) -> dict[str, float]:
        """Compressed-cache bytes per token position, by kind (what grows with context length)."""
        cfg, out = self.config, {"csa_kv": 0.0, "hca_kv": 0.0, "indexer_keys": 0.0}
        for ratio in self.ratios:
            if ratio == cfg.csa_ratio:
                out["csa_kv"] += cfg.head_dim / ratio * self.element_bytes
                out["indexer_keys"] += self.index_key_bytes() / ratio
            elif ratio:
                out["hca_kv"] += cfg.head_dim / ratio * self.element_bytes
        return out


class KVCache:
    """All cache tensors of one model replica; the layers index it by layer id."""

    def __init__(
        self,
        config: ModelConfig,
        ratios: list[int],
        num_slots: int,
        num_blocks: int,
        block_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        index_key_format: CacheFormat | None = None,
    ) -> None:
        self.config, self.num_slots, self.num_blocks, self.block_tokens = config, num_slots, num_blocks, block_tokens
        if index_key_format is not None:
            index_key_format.check_channels(config.index_head_dim)
        self.index_key_format = index_key_format
        element_bytes = torch.finfo(dtype).bits // 8
        self.layout = CacheLayout(config, tuple(ratios), block_tokens, element_bytes, index_key_format)
        # Every layer's ring is a view of one stack, so a fixed-width rollback reaches all of them in one gather.
        shape = (len(ratios), num_slots, config.sliding_window, config.head_dim)
        self.window_stack = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [self._layer(r, self.window_stack[i], num_blocks, dtype, device) for i, r in enumerate(ratios)]

    spare_blocks = 1  # the trash block, allocated beside the pool

    @property
    def trash_block(self) -> int:
        """Block id past the pool that absorbs writes a step makes but does not keep; never in a block table."""
        return self.num_blocks

    def slot_bytes(self) -> int:
        """Bytes one state slot costs (the same accounting ``KVCacheV41`` offers, so the engine sizes both alike)."""
        return self.layout.slot_bytes()

    def block_bytes(self) -> int:
        """Bytes one block of compressed entries costs."""
        return self.layout.block_bytes()

    def rollback_compressors(self, num_layers: int) -> Iterator[CompressorTensors]:
        """The main and indexer compressors of the first ``num_layers`` layers, as rollback reads them."""
        for layer in self.layers[:num_layers]:
            for compressor in (layer.compressor, layer.indexer):
                if compressor is not None:
                    previous = (compressor.previous_values, compressor.previous_gates) if compressor.overlap else None
                    pending = (compressor.pending_values, compressor.pending_gates)
                    yield CompressorTensors(compressor, compressor.ratio, pending, previous, compressor.entry_tensors())

    def slot_tensors(self) -> list[torch.Tensor | None]:
        """Every tensor indexed by state slot: windows and the compressors' unfinished windows."""
        out: list[torch.Tensor | None] = []
        for layer in self.layers:
            out.append(layer.window)
            for compressor in (layer.compressor, layer.indexer):
                if compressor is not None:
                    out += [compressor.pending_values, compressor.pending_gates,
                            compressor.previous_values, compressor.previous_gates]  # fmt: skip
        return out

    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block: the compressed entries, the index keys and, coded, their scales."""
        compressors = [c for layer in self.layers for c in (layer.compressor, layer.indexer) if c is not None]
        return [tensor for compressor in compressors for tensor in compressor.entry_tensors()]

    def copy_sequence(self, source_slot: int, target_slot: int, source_blocks, target_blocks) -> None:
        """Copy one sequence's state onto another slot and other blocks (:mod:`dsinfer.kv.sequence_copy`)."""
        copy_sequence_state(self, source_slot, target_slot, source_blocks, target_blocks)

    def ring_stacks(self, num_layers: int) -> list[torch.Tensor]:
        """The rings of the first ``num_layers`` layers as one tensor [num_layers, slots, window, head_dim] (each
        layer's ``window`` is a view of it)."""
        return [self.window_stack[:num_layers]]

    def _layer(self, ratio: int, window: torch.Tensor, blocks: int, dtype: torch.dtype, device) -> LayerCache:
        cfg, slots = self.config, window.shape[0]
        if not ratio:
            return LayerCache(window, None, None)
        overlap = ratio == cfg.csa_ratio
        compressor = self._compressor(ratio, cfg.head_dim, overlap, slots, blocks, dtype, device)
        indexer = None
        if overlap:
            indexer = self._compressor(ratio, cfg.index_head_dim, True, slots, blocks, dtype, device,
                                       self.index_key_format)  # fmt: skip
        return LayerCache(window, compressor, indexer)

    def _compressor(self, ratio, dim, overlap, slots, blocks, dtype, device, entry_format=None) -> CompressorCache:
        width = (2 if overlap else 1) * dim

        def state() -> torch.Tensor:
            return torch.zeros(slots, ratio, width, dtype=dtype, device=device)

        # One block more than the pool: the trash block, where batched writes of entries that are not complete yet
        # go (a device-side choice of destination, so no host read decides whether to write).
        rows = (blocks + 1, self.block_tokens // ratio)
        scales = None
        if entry_format is None:
            entries = torch.zeros(*rows, dim, dtype=dtype, device=device)
        else:
            entries = torch.zeros(*rows, entry_format.code_width(dim), dtype=entry_format.code_dtype, device=device)
            scales = torch.zeros(*rows, entry_format.scale_width(dim), dtype=entry_format.scale_dtype, device=device)
        return CompressorCache(
            ratio=ratio,
            dim=dim,
            overlap=overlap,
            pending_values=state(),
            pending_gates=state(),
            previous_values=state() if overlap else None,
            previous_gates=state() if overlap else None,
            entries=entries,
            entry_format=entry_format,
            entry_scales=scales,
        )

    @classmethod
    def scratch(
        cls, config: ModelConfig, seq_lens: list[int], dtype: torch.dtype, device, with_mtp: bool = True
    ) -> KVCache:
        """A throw-away cache just big enough for whole sequences run from position 0 (no engine)."""
        block_tokens = block_tokens_for(config)
        blocks = sum(math.ceil(n / block_tokens) for n in seq_lens)
        return cls(config, attention_layer_ratios(config, with_mtp), len(seq_lens), blocks, block_tokens, dtype, device)
