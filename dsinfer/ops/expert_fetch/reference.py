"""The truth for ``copy_expert_rows``: a fixed-shape masked row copy in torch."""

from __future__ import annotations

import torch

from dsinfer.ops.registry import REFERENCE, register

__all__ = ["as_rows", "check_rows", "copy_expert_rows_reference"]


def as_rows(part: torch.Tensor) -> torch.Tensor:
    """``part`` ``[experts, ...]`` (contiguous) as one row of words per expert: 8-byte words when the row's bytes
    allow it (fewer, wider loads for the kernel), else bytes. A view: writes reach ``part``."""
    flat = part.reshape(part.shape[0], -1).view(torch.uint8)
    return flat.view(torch.int64) if flat.shape[1] % 8 == 0 else flat


def check_rows(source: torch.Tensor, target: torch.Tensor, source_rows: torch.Tensor, target_rows: torch.Tensor):
    """Shape and dtype checks every backend shares (host-side metadata only)."""
    if source.dim() != 2 or target.dim() != 2 or source.shape[1] != target.shape[1] or source.dtype != target.dtype:
        raise ValueError(f"source {source.dtype} {tuple(source.shape)} and target {target.dtype} "
                         f"{tuple(target.shape)} must be rows of the same words")  # fmt: skip
    if source_rows.shape != target_rows.shape or source_rows.dim() != 1:
        raise ValueError(f"source_rows {tuple(source_rows.shape)} and target_rows {tuple(target_rows.shape)} "
                         "must be one list of the same length")  # fmt: skip
    if source_rows.dtype != torch.int64 or target_rows.dtype != torch.int64:
        raise ValueError(f"row lists must be int64, got {source_rows.dtype} and {target_rows.dtype}")


@register("copy_expert_rows", REFERENCE)
def copy_expert_rows_reference(
    source: torch.Tensor, target: torch.Tensor, source_rows: torch.Tensor, target_rows: torch.Tensor
) -> None:
    """``target[target_rows[i]] = source[source_rows[i]]`` where ``source_rows[i] >= 0`` (in place).

    Every entry is gathered and written back (the skipped ones with the target's own row), so no shape depends
    on how many rows are copied: the CPU runs the same fixed-size lists a captured step runs."""
    check_rows(source, target, source_rows, target_rows)
    if source.shape[0] == 0 or source_rows.numel() == 0:
        return
    take = (source_rows >= 0).unsqueeze(1)
    rows = source.index_select(0, source_rows.clamp(min=0).to(source.device)).to(target.device)
    kept = target.index_select(0, target_rows)
    target.index_copy_(0, target_rows, torch.where(take, rows, kept))
