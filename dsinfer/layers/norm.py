"""RMS normalisation, with and without a learned weight."""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.layers.op_binding import reference_ops
from dsinfer.ops.norm_rope import rms_normalize_reference
from dsinfer.ops.registry import OpTable


class RMSNorm(nn.Module):
    """RMSNorm whose weight stays in float32: DeepSeek keeps norm weights in fp32 and casts once at the end."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.ops: OpTable = reference_ops()  # the model binds its table when it is built

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


def rms_normalize(x: torch.Tensor, eps: float, ops: OpTable | None = None) -> torch.Tensor:
    """Weightless RMSNorm over the last axis (the per-head query norm and the mHC input norm).

    ``ops``: the model's op table (its ``rms_normalize`` backend); without one the torch reference runs."""
    return (ops.rms_normalize if ops is not None else rms_normalize_reference)(x, eps)
