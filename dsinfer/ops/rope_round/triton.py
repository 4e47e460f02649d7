"""``rope_and_round`` on CUDA: the row-chain kernel of :mod:`dsinfer.ops.norm_rope.row_chain_triton` with the
weighted norm (or none) and V4.1's rounding (or none), one launch per chain; how each stage rounds, and why the
result is the unfused kernels' bit for bit, is told there."""

from __future__ import annotations

import torch

from dsinfer.ops.norm_rope.rope_triton import rope_triton
from dsinfer.ops.norm_rope.row_chain_triton import NO_NORM, WEIGHTED_NORM, ChainRows, launch, takes
from dsinfer.ops.registry import register
from dsinfer.ops.rope_round.reference import RopeRoundInputs, rope_and_round_reference
from dsinfer.ops.triton_support import triton_available


def kernel_takes(inputs: RopeRoundInputs) -> bool:
    """Whether the row-chain kernel takes the chain (:func:`~dsinfer.ops.norm_rope.row_chain_triton.takes`)."""
    return takes(inputs.x, inputs.cos, inputs.sin, inputs.weight, inputs.rounding, inputs.block)


def chain_rows_of(inputs: RopeRoundInputs) -> ChainRows:
    """The chain as the row-chain kernel's launch takes it: the weighted norm where there is a weight, else none."""
    norm = NO_NORM if inputs.weight is None else WEIGHTED_NORM
    return ChainRows(inputs.x, inputs.cos, inputs.sin, inputs.weight, inputs.eps, norm, inputs.rounding, inputs.block)


@register("rope_and_round", "triton", devices=("cuda",), available=triton_available, priority=10)
def rope_and_round_triton(inputs: RopeRoundInputs) -> torch.Tensor:
    """Same contract as :func:`rope_and_round_reference`; inputs the kernel does not take go to it (a bare RoPE to
    the ``rope`` op's backend)."""
    if not kernel_takes(inputs):
        if inputs.weight is None and inputs.rounding is None:
            return rope_triton(inputs.x, inputs.cos, inputs.sin)
        return rope_and_round_reference(inputs)
    return launch(chain_rows_of(inputs))
