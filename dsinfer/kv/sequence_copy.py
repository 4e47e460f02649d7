"""Copy one sequence's cache state onto another's: its slot rows and its blocks, on the device, nothing shared.

A cache keeps two kinds of per-sequence state: rows indexed by the sequence's state slot (sliding windows,
unfinished compressor windows, V4.1's Engram history and draft rings) and rows indexed by its blocks (compressed
entries, index keys, their scales). Each cache class names its tensors of both kinds; this copies them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def copy_rows(tensors: Iterable[torch.Tensor | None], sources: Sequence[int], targets: Sequence[int]) -> None:
    """``tensor[targets[i]] = tensor[sources[i]]`` along dim 0 of every tensor (None entries are skipped)."""
    if len(sources) != len(targets):
        raise ValueError(f"copy_rows: {len(sources)} source rows but {len(targets)} target rows")
    if not sources:
        return
    index_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        if tensor.device not in index_cache:
            index_cache[tensor.device] = (
                torch.tensor(list(sources), dtype=torch.long, device=tensor.device),
                torch.tensor(list(targets), dtype=torch.long, device=tensor.device),
            )
        src, dst = index_cache[tensor.device]
        raw = tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor  # FP8 codes: copied as bytes
        raw.index_copy_(0, dst, raw.index_select(0, src))


def copy_sequence_state(cache, source_slot: int, target_slot: int, source_blocks: Sequence[int],
                        target_blocks: Sequence[int]) -> None:  # fmt: skip
    """Copy a sequence's slot rows and blocks in ``cache`` (which names them: ``slot_tensors()``,
    ``block_tensors()``) from ``source_slot`` / ``source_blocks`` to ``target_slot`` / ``target_blocks``."""
    copy_rows(cache.slot_tensors(), [source_slot], [target_slot])
    copy_rows(cache.block_tensors(), list(source_blocks), list(target_blocks))
