"""What one sequence's caches take at a context, per layer kind and storage: the arithmetic both the sweep's budget
check (:mod:`dsinfer.bench.cache_budget`) and the serving plan (:mod:`dsinfer.memory_plan`) print.

It follows the engine's byte accounting (:meth:`~dsinfer.kv.cache_v4.CacheLayout.slot_bytes` / ``block_bytes``,
:meth:`~dsinfer.kv.cache_v41.KVCacheV41.slot_bytes` / ``block_bytes``) split by layer kind, before any engine or
cache exists. Two storages per model family:

* V4: ``bf16`` (every row in the model dtype) and ``fp8`` (the engine's ``kv_cache_dtype: fp8``: the indexer keys
  as the release keeps them, e4m3 codes with a ue8m0 exponent per 128 channels; the other rows stay bf16);
* V4.1: ``bf16`` (plain values) and ``fp8`` (the release's cache, what the engine keeps whenever the model's
  trained-in rounding is on: window KV FP8, compressed entries and index keys FP4,
  :mod:`dsinfer.kv.codecs`); unfinished ratio-2 groups stay fp32 in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsinfer.config import ModelConfig, ModelConfigV41
from dsinfer.kv.codecs import (
    COMPRESSED_KV_FORMAT,
    INDEX_KEY_FORMAT,
    INDEX_KEY_FP8_FORMAT,
    WINDOW_KV_FORMAT,
    CacheFormat,
    index_key_fp8_format,
)

ENGRAM_ID_BYTES = 8  # int64 compressed token ids of the Engram history
PENDING_GROUP_BYTES = 4  # V4.1 keeps unfinished ratio-2 groups in fp32


@dataclass(frozen=True)
class CacheStorage:
    """How cached rows are kept: plain values of ``element_bytes``, or a block-scaled format per row family."""

    name: str
    element_bytes: int
    window: CacheFormat | None = None
    entries: CacheFormat | None = None
    index_keys: CacheFormat | None = None

    def row_bytes(self, fmt: CacheFormat | None, channels: int) -> int:
        return channels * self.element_bytes if fmt is None else fmt.row_bytes(channels)


def v4_storages() -> dict[str, CacheStorage]:
    return {"bf16": CacheStorage("bf16", 2), "fp8": CacheStorage("fp8", 2, index_keys=INDEX_KEY_FP8_FORMAT)}


def v41_storages() -> dict[str, CacheStorage]:
    quantized = CacheStorage("fp8", 2, WINDOW_KV_FORMAT, COMPRESSED_KV_FORMAT, INDEX_KEY_FORMAT)
    return {"bf16": CacheStorage("bf16", 2), "fp8": quantized}


@dataclass(frozen=True)
class KindBytes:
    """One layer kind's cache for one sequence: state that does not grow (window ring, unfinished groups) and the
    compressed entries plus index keys that grow with the context, per layer of the kind."""

    kind: str
    layers: int
    state_bytes: int
    entry_bytes: int

    @property
    def per_layer(self) -> int:
        return self.state_bytes + self.entry_bytes

    @property
    def total(self) -> int:
        return self.layers * self.per_layer


def _grouped(rows: list[KindBytes]) -> list[KindBytes]:
    """Merge layers of the same kind (same bytes), keeping first-seen order."""
    merged: dict[str, KindBytes] = {}
    for row in rows:
        seen = merged.get(row.kind)
        merged[row.kind] = row if seen is None else KindBytes(row.kind, seen.layers + row.layers, row.state_bytes,
                                                              row.entry_bytes)  # fmt: skip
    return list(merged.values())


def v4_kind_bytes(
    config: ModelConfig, tokens: int, block_tokens: int, storage: CacheStorage, mtp_layers: int = 0
) -> list[KindBytes]:
    """V4's window / CSA / HCA layers (and the MTP layers' windows when drafting) for one ``tokens``-long sequence."""
    blocks, rows = math.ceil(tokens / block_tokens), []
    window = config.sliding_window * storage.row_bytes(storage.window, config.head_dim)
    state_element = storage.element_bytes
    index_keys = storage.index_keys
    if index_keys is INDEX_KEY_FP8_FORMAT:  # the engine's format for this model's key width
        index_keys = index_key_fp8_format(config.index_head_dim)
    for ratio in (*config.compress_ratios, *(0,) * mtp_layers):
        if not ratio:
            rows.append(KindBytes("window" if len(rows) < config.num_hidden_layers else "MTP window", 1, window, 0))
            continue
        entries = blocks * block_tokens // ratio
        if ratio == config.csa_ratio:  # overlapping windows: pending + previous, values + gates, 2 x width
            state = 4 * ratio * 2 * (config.head_dim + config.index_head_dim) * state_element
            row = storage.row_bytes(storage.entries, config.head_dim)
            row += storage.row_bytes(index_keys, config.index_head_dim)
            rows.append(KindBytes(f"CSA (ratio {ratio})", 1, window + state, entries * row))
        else:
            state = 2 * ratio * config.head_dim * state_element
            row = storage.row_bytes(storage.entries, config.head_dim)
            rows.append(KindBytes(f"HCA (ratio {ratio})", 1, window + state, entries * row))
    return _grouped(rows)


def v41_layer_kind(config: ModelConfigV41, layer_id: int) -> str:
    """A V4.1 layer's role as its cache sees it."""
    ratio = config.compress_ratios[layer_id]
    if not ratio:
        return "window"
    if config.is_kv_source(layer_id):
        return f"ratio-{ratio} KV source"
    if config.is_index_source(layer_id):
        return f"ratio-{ratio} keyless index source"
    return f"ratio-{ratio} reader"


def v41_kind_bytes(
    config: ModelConfigV41, tokens: int, block_tokens: int, storage: CacheStorage, dspark_stages: int = 0
) -> list[KindBytes]:
    """V4.1's layer kinds for one ``tokens``-long sequence, plus its Engram history and DSpark rings (per model)."""
    blocks, rows = math.ceil(tokens / block_tokens), []
    window = config.sliding_window * storage.row_bytes(storage.window, config.head_dim)
    for layer_id, ratio in enumerate(config.compress_ratios):
        if not config.is_kv_source(layer_id):
            rows.append(KindBytes(v41_layer_kind(config, layer_id), 1, window, 0))
            continue
        pending = 2 * ratio * config.head_dim * PENDING_GROUP_BYTES if ratio > 1 else 0
        row = storage.row_bytes(storage.entries, config.head_dim)
        row += storage.row_bytes(storage.index_keys, config.index_head_dim)
        entries = blocks * block_tokens // ratio * row
        rows.append(KindBytes(v41_layer_kind(config, layer_id), 1, window + pending, entries))
    rows.append(KindBytes("Engram history", 1, (config.engram_max_ngram_size - 1) * ENGRAM_ID_BYTES, 0))
    if dspark_stages:
        ring = config.sliding_window * config.head_dim * storage.element_bytes
        rows.append(KindBytes("DSpark ring", dspark_stages, ring, 0))
    return _grouped(rows)


def sequence_bytes(kinds: list[KindBytes]) -> int:
    return sum(kind.total for kind in kinds)


def format_bytes(count: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count:.0f} B"
