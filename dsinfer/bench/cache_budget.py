"""What one sequence's caches take at a context, per layer kind and storage, and how many sequences fit a budget.

A sweep point of n sequences at 131,072 tokens either fits the cache budget beside the weights or fails late, as
an out-of-memory error in the middle of the fill. This module does the engine's byte accounting
(:meth:`~dsinfer.kv.cache_v4.CacheLayout.slot_bytes` / ``block_bytes``, :meth:`~dsinfer.kv.cache_v41.KVCacheV41.
slot_bytes` / ``block_bytes``) split by layer kind, before any engine exists, so the sweep can print where the
bytes go and refuse a point that cannot fit with one message.

Two storages per model family:

* V4: ``bf16`` (what the engine keeps today: every row in the model dtype) and ``fp8`` (window KV, compressed KV
  and indexer keys as e4m3 codes with a ue8m0 exponent per 32 channels; the compressors' unfinished windows stay
  in bf16);
* V4.1: ``bf16`` (plain values) and ``fp8`` (the release's cache, what the engine keeps whenever the model's
  trained-in rounding is on: window KV FP8, compressed entries and index keys FP4,
  :mod:`dsinfer.kv.codecs`); unfinished ratio-2 groups stay fp32 in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsinfer.config import ModelConfig, ModelConfigV41
from dsinfer.kv.codecs import COMPRESSED_KV_FORMAT, INDEX_KEY_FORMAT, WINDOW_KV_FORMAT, CacheFormat

V4_FP8_FORMAT = CacheFormat("V4 FP8 rows", "e4m3", 32, "ue8m0")
ENGRAM_ID_BYTES = 8  # int64 compressed token ids of the Engram history
PENDING_GROUP_BYTES = 4  # V4.1 keeps unfinished ratio-2 groups in fp32
CPU_CACHE_BYTES = 512 * 2**20  # the engine's cache on the CPU when no budget is given
GPU_MEMORY_UTILIZATION = 0.9  # the engine's default share of the GPU


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
    return {"bf16": CacheStorage("bf16", 2), "fp8": CacheStorage("fp8", 2, *(V4_FP8_FORMAT,) * 3)}


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
    for ratio in (*config.compress_ratios, *(0,) * mtp_layers):
        if not ratio:
            rows.append(KindBytes("window" if len(rows) < config.num_hidden_layers else "MTP window", 1, window, 0))
            continue
        entries = blocks * block_tokens // ratio
        if ratio == config.csa_ratio:  # overlapping windows: pending + previous, values + gates, 2 x width
            state = 4 * ratio * 2 * (config.head_dim + config.index_head_dim) * state_element
            row = storage.row_bytes(storage.entries, config.head_dim)
            row += storage.row_bytes(storage.index_keys, config.index_head_dim)
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


def cache_budget(cache_gib: float | None, device: torch.device) -> tuple[int, str]:
    """The bytes the sweep's caches may take, and where that number comes from (the engine's own rule)."""
    if cache_gib is not None:
        return int(cache_gib * 2**30), "--cache-gib"
    if device.type != "cuda":
        return CPU_CACHE_BYTES, "the engine's CPU default"
    free, total = torch.cuda.mem_get_info(device)
    kept = 1 - GPU_MEMORY_UTILIZATION
    return int(free - total * kept), f"free GPU memory after the weights, less {kept:.0%} of the GPU kept for work"


def format_bytes(count: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count:.0f} B"


def describe_kinds(tables: dict[str, list[KindBytes]], tokens: int, engine_storage: str) -> list[str]:
    """Lines of a table: each kind's layers and bytes per layer in every storage, then the per-sequence totals."""
    names = list(tables)
    lines = [f"cache per sequence at {tokens:,} tokens, per layer kind (the engine keeps {engine_storage}):",
             f"  {'kind':<34}{'layers':>7}" + "".join(f"{name + ' per layer':>20}" for name in names)]  # fmt: skip
    first = tables[names[0]]
    for index, kind in enumerate(first):
        cells = "".join(f"{format_bytes(tables[name][index].per_layer):>20}" for name in names)
        lines.append(f"  {kind.kind:<34}{kind.layers:>7}{cells}")
    totals = "".join(f"{format_bytes(sequence_bytes(tables[name])):>20}" for name in names)
    lines.append(f"  {'per sequence':<41}{totals}")
    return lines


def sequences_that_fit(budget: int, per_sequence: int) -> int:
    return max(0, budget // max(per_sequence, 1))


def refusal(point: int, tokens: int, per_sequence: int, budget: tuple[int, str]) -> str | None:
    """None when ``point`` sequences of ``tokens`` fit the budget; else the one message that says why not."""
    fit = sequences_that_fit(budget[0], per_sequence)
    if point <= fit:
        return None
    need, each, have = format_bytes(point * per_sequence), format_bytes(per_sequence), format_bytes(budget[0])
    return (f"{point} sequences of {tokens:,} tokens need {need} of cache ({each} each) but the budget is {have} "
            f"({budget[1]}): at most {fit} fit; lower the point or raise --cache-gib")  # fmt: skip
