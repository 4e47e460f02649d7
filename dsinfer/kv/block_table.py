"""A sequence's block table as a device tensor: rows of ``DeviceSpans.block_tables`` pass through unchanged."""

from __future__ import annotations

import torch


def block_table_tensor(block_table: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The table as a long tensor on ``device``; a device row (built once per step) costs nothing."""
    if isinstance(block_table, torch.Tensor):
        return block_table
    return torch.tensor(block_table, dtype=torch.long, device=device)
