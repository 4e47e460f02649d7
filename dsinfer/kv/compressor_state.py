"""One compressor's state as a cache holds it, in the one shape speculative rollback reads from either cache.

V4's cache keeps a main and an indexer compressor per compressed layer (overlapping at the CSA ratio: the last
complete window too); V4.1's keeps one per KV source (ratio 1: no unfinished window) with its index keys and,
in coded storage, their scales. Each cache lists its compressors as :class:`CompressorTensors`
(``rollback_compressors``), so rollback never asks which cache it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CompressorTensors:
    """One compressor's state, whichever cache holds it."""

    journal_key: object  # the state object the compressor names in the span's journal
    ratio: int
    pending: tuple[torch.Tensor, torch.Tensor] | None  # unfinished window [slots, ratio, width]; None: ratio 1
    previous: tuple[torch.Tensor, torch.Tensor] | None  # overlapping only: the last complete window
    entries: list[torch.Tensor]  # [blocks, block_tokens // ratio, ...]: entries, index keys, their scales
