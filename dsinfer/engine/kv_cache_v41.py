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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsinfer.config_v41 import ModelConfigV41
from dsinfer.engram.hashing import ENGRAM_DEAD

DEFAULT_BLOCK_TOKENS = 64


@dataclass
class SourceCache:
    """State of one KV source layer's compressor across all slots and blocks."""

    ratio: int
    pending_values: torch.Tensor | None  # [slots, ratio, head_dim] fp32 (ratio > 1 only)
    pending_gates: torch.Tensor | None  # [slots, ratio, head_dim] fp32
    entries: torch.Tensor  # [blocks, block_tokens // ratio, head_dim]
    index_keys: torch.Tensor  # [blocks, block_tokens // ratio, index_head_dim]


@dataclass
class LayerCacheV41:
    window: torch.Tensor  # [slots, window, head_dim]
    source: SourceCache | None  # only on KV-source layers


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
    """All cache tensors of one V4.1 model replica; the layers index ``layers`` by layer id."""

    def __init__(
        self,
        config: ModelConfigV41,
        num_slots: int,
        num_blocks: int,
        block_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        with_dspark: bool = False,
    ) -> None:
        block_tokens = block_tokens_for_v41(config, block_tokens)
        self.config, self.num_slots, self.num_blocks, self.block_tokens = config, num_slots, num_blocks, block_tokens
        self.element_bytes = torch.finfo(dtype).bits // 8
        self.layers = [self._layer(i, dtype, device) for i in range(config.num_hidden_layers)]
        width = config.engram_max_ngram_size - 1
        self.engram_history = torch.full((num_slots, width), ENGRAM_DEAD, dtype=torch.int64, device=device)
        stages = config.num_nextn_predict_layers if with_dspark else 0
        shape = (num_slots, config.sliding_window, config.head_dim)
        self.dspark_rings = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(stages)]

    def _layer(self, layer_id: int, dtype: torch.dtype, device) -> LayerCacheV41:
        cfg, slots = self.config, self.num_slots
        window = torch.zeros(slots, cfg.sliding_window, cfg.head_dim, dtype=dtype, device=device)
        if not cfg.is_kv_source(layer_id):
            return LayerCacheV41(window, None)
        ratio = cfg.compress_ratios[layer_id]
        per_block = self.block_tokens // ratio

        def pending() -> torch.Tensor | None:
            if ratio == 1:
                return None
            return torch.zeros(slots, ratio, cfg.head_dim, dtype=torch.float32, device=device)

        source = SourceCache(
            ratio=ratio,
            pending_values=pending(),
            pending_gates=pending(),
            entries=torch.zeros(self.num_blocks, per_block, cfg.head_dim, dtype=dtype, device=device),
            index_keys=torch.zeros(self.num_blocks, per_block, cfg.index_head_dim, dtype=dtype, device=device),
        )
        return LayerCacheV41(window, source)

    # ---- accounting ------------------------------------------------------------------------------
    def slot_bytes(self) -> int:
        """Bytes one state slot costs: windows, unfinished groups, Engram ids, DSpark rings."""
        cfg, total = self.config, 0
        for layer in self.layers:
            total += cfg.sliding_window * cfg.head_dim * self.element_bytes
            if layer.source is not None and layer.source.pending_values is not None:
                total += 2 * layer.source.ratio * cfg.head_dim * 4
        total += (cfg.engram_max_ngram_size - 1) * 8
        total += len(self.dspark_rings) * cfg.sliding_window * cfg.head_dim * self.element_bytes
        return total

    def block_bytes(self) -> int:
        """Bytes one block costs: every source's entries and index keys for ``block_tokens`` positions."""
        cfg, total = self.config, 0
        for layer in self.layers:
            if layer.source is not None:
                total += self.block_tokens // layer.source.ratio * (cfg.head_dim + cfg.index_head_dim)
        return total * self.element_bytes

    def bytes_per_token(self) -> float:
        """Compressed-cache bytes per token position (what grows with the context)."""
        return self.block_bytes() / self.block_tokens

    @classmethod
    def scratch(
        cls, config: ModelConfigV41, seq_lens: list[int], dtype: torch.dtype, device, with_dspark: bool = False
    ) -> KVCacheV41:
        """A throw-away cache just big enough for whole sequences run from position 0 (no engine)."""
        block_tokens = block_tokens_for_v41(config)
        blocks = sum(math.ceil(n / block_tokens) for n in seq_lens)
        return cls(config, len(seq_lens), blocks, block_tokens, dtype, device, with_dspark)
