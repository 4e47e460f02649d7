"""Token compressors: pool every ``ratio`` tokens of a sequence into one compressed KV entry.

Each token contributes a value ``wkv(x)`` and a gate ``wgate(x) + ape[slot]``; an entry is the
per-channel softmax(gate)-weighted sum of its window's values, then RMSNorm and RoPE at the window's
first position. CSA (ratio 4) windows overlap: each token projects to two halves, ``Ca`` feeding the next
window and ``Cb`` its own, so an entry pools 2 * ratio slots. HCA (ratio 128) windows do not overlap.
The lightning indexer owns a second, narrower compressor of the same kind.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.rotary import apply_rope, rope_angles


class Compressor(nn.Module):
    def __init__(self, hidden_size: int, dim: int, ratio: int, overlap: bool, norm_eps: float) -> None:
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = 2 * dim if overlap else dim
        self.wkv = nn.Linear(hidden_size, width, bias=False)
        self.wgate = nn.Linear(hidden_size, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, norm_eps)

    def forward(self, x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """Compress one sequence's hidden states [S, hidden] into [S // ratio, dim] entries (complete windows)."""
        n_windows = x.shape[0] // self.ratio
        usable = n_windows * self.ratio
        if n_windows == 0:
            return x.new_zeros((0, self.dim))
        values = self.wkv(x[:usable]).view(n_windows, self.ratio, -1)
        gates = self.wgate(x[:usable]).view(n_windows, self.ratio, -1) + self.ape
        if self.overlap:
            values, gates = self._overlapping_slots(values, gates)
        weights = gates.softmax(dim=1, dtype=torch.float32).to(values.dtype)
        pooled = self.norm((values * weights).sum(dim=1))
        positions = torch.arange(n_windows, device=x.device) * self.ratio
        cos, sin = rope_angles(positions, inv_freq)
        return apply_rope(pooled, cos, sin)

    def _overlapping_slots(self, values: torch.Tensor, gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Window w pools the previous window's ``Ca`` half and its own ``Cb`` half (2 * ratio slots).

        Window 0 has no predecessor: its ``Ca`` slots get zero value and -inf gate (softmax weight 0).
        """
        dim = self.dim
        previous_values = torch.zeros_like(values[..., :dim])
        previous_gates = torch.full_like(gates[..., :dim], float("-inf"))
        previous_values[1:] = values[:-1, :, :dim]
        previous_gates[1:] = gates[:-1, :, :dim]
        slots_values = torch.cat([previous_values, values[..., dim:]], dim=1)
        slots_gates = torch.cat([previous_gates, gates[..., dim:]], dim=1)
        return slots_values, slots_gates


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """How many compressed entries each query position may see: entry w needs all of its window."""
    return torch.div(positions + 1, ratio, rounding_mode="floor")
