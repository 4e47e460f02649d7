"""A linear layer that keeps its checkpoint's block-scaled FP8 weight (codes + ue8m0 scales) as stored.

The loader puts one in place of an ``nn.Linear`` whose checkpoint tensor is FP8 when the FP8 linears are kept
(``fp8_linears="keep"``): half the bytes of bf16. ``forward`` goes through the ``fp8_linear`` op (a grouped
projection such as the attention's ``wo_a`` too), whose Triton backend reads the codes; ``weight`` is the
dequantised weight in the compute dtype for code that reads weights directly. :class:`Fp8Stack` joins FP8
linears that read one input into one call.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.layers.op_binding import reference_ops
from dsinfer.ops.fp8_linear.reference import Fp8Weight
from dsinfer.ops.quant import dequantize_fp8_blockwise
from dsinfer.ops.registry import OpTable


class Fp8Linear(nn.Module):
    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        block: tuple[int, int],
        dtype: torch.dtype,
        ops: OpTable | None = None,
    ) -> None:
        """``ops``: the table of the model it goes into (None: the torch references, a linear on its own)."""
        super().__init__()
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.block = tuple(block)
        self.compute_dtype = dtype
        self.ops: OpTable = ops if ops is not None else reference_ops()

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def weight(self) -> torch.Tensor:
        return dequantize_fp8_blockwise(self.codes, self.scale, self.block, dtype=self.compute_dtype)

    def forward(self, x: torch.Tensor, groups: int = 1) -> torch.Tensor:
        """``x @ W.T``; ``groups`` > 1: a grouped projection (``x`` [..., groups * in], see the op)."""
        return self.ops.fp8_linear(x, Fp8Weight(self.codes, self.scale, self.block), self.compute_dtype, groups)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, fp8"


class Fp8Stack:
    """FP8 linears that read one input, their codes and scales stacked (theirs become views of its rows), so one
    kernel gives every output: :func:`~dsinfer.layers.joined_linear.join_linears` for FP8 kept as stored.

    Not a module: the stack is no buffer, so the state dict keeps only the linears' own names."""

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype, ops: OpTable
    ) -> None:
        self.codes, self.scale, self.block, self.compute_dtype, self.ops = codes, scale, tuple(block), dtype, ops

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @classmethod
    def join(cls, *linears: nn.Module | None) -> Fp8Stack | None:
        """None (nothing changed) unless every linear is an :class:`Fp8Linear` of one block, compute dtype, device
        and input width, each with whole scale blocks of rows (so every linear's rows keep their own scales)."""
        if not linears or any(type(linear) is not Fp8Linear for linear in linears):
            return None
        first = linears[0]
        kinds = {(linear.block, linear.compute_dtype, linear.codes.device, linear.in_features) for linear in linears}
        if len(kinds) != 1 or any(linear.out_features % first.block[0] for linear in linears):
            return None
        with torch.no_grad():
            codes = torch.cat([linear.codes for linear in linears])
            scale = torch.cat([linear.scale for linear in linears])
            stack = cls(codes, scale, first.block, first.compute_dtype, first.ops)
            start = 0
            for linear in linears:
                linear.codes, linear.scale = stack.rows(start, start + linear.out_features)
                start += linear.out_features
        return stack

    def holds(self, *linears: nn.Module) -> bool:
        """Whether the linears' codes are still this stack's consecutive rows (what :meth:`join` left)."""
        start = 0
        for linear in linears:
            if type(linear) is not Fp8Linear or start >= self.out_features:
                return False
            if linear.codes.data_ptr() != self.codes[start].data_ptr():
                return False
            start += linear.out_features
        return start == self.out_features

    def rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and scales of rows ``start:stop`` (whole scale blocks)."""
        block_rows = self.block[0]
        if start % block_rows or stop % block_rows:
            raise ValueError(f"rows {start}:{stop} do not start and end on {block_rows}-row scale blocks")
        return self.codes[start:stop], self.scale[start // block_rows : stop // block_rows]

    def __call__(self, x: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Output columns ``start:stop`` (default: all) of the stacked projection."""
        codes, scale = self.rows(start, self.out_features if stop is None else stop)
        return self.ops.fp8_linear(x, Fp8Weight(codes, scale, self.block), self.compute_dtype)
