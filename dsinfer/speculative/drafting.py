"""What every drafter shares: the kept positions it reads and the drafts it returns.

A step's target forward keeps what the drafter reads of the target at every position
(``ServedModel.forward_for_drafter``): V4's MTP layer the residual streams, V4.1's DSpark stages the mean streams
entering ``dspark_target_layer_ids``. After judging, the engine hands back the positions each span kept
(:class:`DraftInput`) and the drafter proposes the next tokens of every sampled sequence.

Verify steps of fixed width (every sequence its last token and ``num_tokens`` drafts, what a CUDA graph
replays) have a static-shape form of both: ``ServedModel.verify_forward`` and :meth:`Drafter.draft_fixed`, from
device tensors alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from dsinfer.kv.batch import SequenceSpan

if TYPE_CHECKING:
    from dsinfer.kv.fixed_width import FixedWidthBatch
    from dsinfer.models.served import ServedModel


@dataclass
class DraftInput:
    """The positions a step kept, as spans over the target features, and which spans draft."""

    target_hidden: torch.Tensor  # [T, ...] what the drafter reads of the target at each kept position, by span
    next_token_ids: torch.Tensor  # [T] the token after each kept position
    positions: torch.Tensor  # [T]
    spans: list[SequenceSpan]  # one per sequence of the step, over the kept positions only
    drafting: list[int]  # indices into ``spans`` of the sequences that draft

    def last_rows(self) -> list[int]:
        """Row of each drafting span's last kept position (its bonus token is the one after it)."""
        ends, offset = [], 0
        for span in self.spans:
            offset += span.length
            ends.append(offset - 1)
        return [ends[i] for i in self.drafting]


class Drafter(Protocol):
    model: ServedModel  # the target, whose forwards keep what the drafter reads
    num_tokens: int

    def draft(self, inputs: DraftInput) -> list[list[int]]:
        """Update the drafter's state from the kept positions; up to ``num_tokens`` drafts per drafting span."""

    def draft_fixed(
        self, batch: FixedWidthBatch, features: torch.Tensor, next_token_ids: torch.Tensor, kept: torch.Tensor
    ) -> torch.Tensor:
        """After a fixed-width verify: each sequence kept its first ``kept`` [B] positions, ``next_token_ids``
        [B, width] the token after each; drafts [B, num_tokens + 1], the last column how many to verify."""
