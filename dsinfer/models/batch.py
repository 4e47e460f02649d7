"""The packed batch the model's forward takes: new tokens of many sequences laid end to end."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    """Tokens of several sequences concatenated, plus where each sequence starts and ends.

    ``positions`` are absolute positions inside each sequence. Every sequence here starts at position 0
    (a whole prompt, no cache); the cache manager extends this object with slot and block tables.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_lens: list[int]

    @classmethod
    def from_sequences(cls, sequences: list[list[int]], device: torch.device | str = "cpu") -> PackedBatch:
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("every sequence in a batch needs at least one token")
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(len(s), device=device) for s in sequences])
        return cls(input_ids=ids, positions=positions, seq_lens=[len(s) for s in sequences])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def sequence_slices(self) -> list[slice]:
        """Token ranges of each sequence inside the packed tensors."""
        slices, start = [], 0
        for length in self.seq_lens:
            slices.append(slice(start, start + length))
            start += length
        return slices

    def last_token_indices(self) -> torch.Tensor:
        ends = torch.tensor(self.seq_lens, device=self.input_ids.device).cumsum(0)
        return ends - 1
