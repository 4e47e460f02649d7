"""What one sequence's caches take at a context, per layer kind and storage, and how many sequences fit a budget.

A sweep point of n sequences at 131,072 tokens either fits the cache budget beside the weights or fails late, as
an out-of-memory error in the middle of the fill. This module does the engine's byte accounting
(:meth:`~dsinfer.kv.cache_v4.CacheLayout.slot_bytes` / ``block_bytes``, :meth:`~dsinfer.kv.cache_v41.KVCacheV41.
slot_bytes` / ``block_bytes``) split by layer kind, before any engine exists, so the sweep can print where the
bytes go and refuse a point that cannot fit with one message.

The per-kind arithmetic itself is :mod:`dsinfer.kv.sequence_bytes` (the serving plan prints it too).
"""

from __future__ import annotations

import torch

from dsinfer.kv.sequence_bytes import (  # noqa: F401  (the sweep and its tests import the arithmetic from here)
    KindBytes,
    format_bytes,
    sequence_bytes,
    v4_kind_bytes,
    v4_storages,
    v41_kind_bytes,
    v41_storages,
)

CPU_CACHE_BYTES = 512 * 2**20  # the engine's cache on the CPU when no budget is given
GPU_MEMORY_UTILIZATION = 0.9  # the engine's default share of the GPU


def cache_budget(cache_gib: float | None, device: torch.device) -> tuple[int, str]:
    """The bytes the sweep's caches may take, and where that number comes from (the engine's own rule)."""
    if cache_gib is not None:
        return int(cache_gib * 2**30), "--cache-gib"
    if device.type != "cuda":
        return CPU_CACHE_BYTES, "the engine's CPU default"
    free, total = torch.cuda.mem_get_info(device)
    kept = 1 - GPU_MEMORY_UTILIZATION
    return int(free - total * kept), f"free GPU memory after the weights, less {kept:.0%} of the GPU kept for work"


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
