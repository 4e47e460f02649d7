"""Structured-output masks for a whole batch: one host bitmask, one copy to the device, one add.

Each constrained row's grammar writes its allowed set into its row of one CPU int32 bitmask (xgrammar's packed
layout: token ``i`` is bit ``i % 32`` of word ``i // 32``); rows whose grammar allows everything are skipped. The
bitmask goes to the device in one pinned, non-blocking copy, and every masked row gets its 0 / -inf penalties
in one gather and one ``index_add_``: the bitmask read as bytes picks, per byte, a row of eight penalties
(little-endian: token ``i`` is bit ``i % 8`` of byte ``i // 8``). Adding 0.0 leaves an allowed logit exactly as
it was, so this equals setting the forbidden logits to -inf.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from dsinfer.sampling.host_copies import device_index

if TYPE_CHECKING:
    from dsinfer.sampling.structured_output import GrammarConstraint

# Row b holds, for the 8 tokens whose bits are byte value b, 0.0 (allowed) or -inf (forbidden).
_BYTE_PENALTIES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _byte_penalties(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    penalties = _BYTE_PENALTIES.get((device, dtype))
    if penalties is None:
        forbidden = (torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 0
        penalties = torch.zeros(256, 8).masked_fill_(forbidden, float("-inf")).to(device, dtype)
        _BYTE_PENALTIES[(device, dtype)] = penalties
    return penalties


def apply_grammar_masks(scores: torch.Tensor, constraints: Sequence[GrammarConstraint | None]) -> torch.Tensor:
    """Mask, in place, the tokens each row's grammar forbids next (row ``i`` of ``scores`` is ``constraints[i]``'s;
    None or an inactive grammar: untouched); returns ``scores``."""
    vocab_size = scores.shape[-1]
    live = [
        (row, constraint) for row, constraint in enumerate(constraints) if constraint is not None and constraint.active
    ]
    if not live:
        return scores
    for _, constraint in live:
        if constraint.vocab_size != vocab_size:
            raise ValueError(f"logits rows must have width {constraint.vocab_size}, got {vocab_size}")
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(live), words), -1, dtype=torch.int32, pin_memory=scores.is_cuda)
    keep = [index for index, (_, constraint) in enumerate(live) if constraint.fill_bitmask(bitmask, index)]
    if not keep:
        return scores
    masked = [live[index][0] for index in keep]
    if len(keep) < len(live):
        bitmask = bitmask[keep]
        bitmask = bitmask.pin_memory() if scores.is_cuda else bitmask
    byte_values = bitmask.view(torch.uint8).to(scores.device, non_blocking=True).to(torch.int32)
    penalties = _byte_penalties(scores.device, scores.dtype).index_select(0, byte_values.view(-1))
    penalties = penalties.view(len(masked), -1)[:, :vocab_size]
    return scores.index_add_(0, device_index(masked, scores.device), penalties)
