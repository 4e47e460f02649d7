"""A linear layer that keeps its checkpoint's block-scaled FP8 weight (codes + ue8m0 scales) as stored.

The loader puts one in place of an ``nn.Linear`` whose checkpoint tensor is FP8 when the FP8 linears are kept
(``fp8_linears="keep"``): half the bytes of bf16. ``weight`` is the dequantised weight in the compute dtype for
code that reads weights directly (the grouped output projection); ``forward`` goes through the ``fp8_linear``
op so a kernel that reads the codes can take over.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.ops.quant import dequantize_fp8_blockwise
from dsinfer.ops.registry import OpTable, resolve


class Fp8Linear(nn.Module):
    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.block = tuple(block)
        self.compute_dtype = dtype
        self.ops: OpTable | None = None

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_fp8_blockwise(self.codes, self.scale, self.block, dtype=self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is None:
            self.ops = resolve(x.device, self.compute_dtype)
        return self.ops.fp8_linear(x, self.codes, self.scale, self.block, self.compute_dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, fp8"
