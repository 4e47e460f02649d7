"""Linears that read the same input, joined into one GEMM for inference.

At a decode step of a few tokens a GEMM is a launch (often two, with cuBLAS's split-K reduction) for a few MiB
of weights, so two projections of the same input cost more as two GEMMs than as one over their stacked weights.
:func:`join_linears` stacks the weights once and makes each linear's weight a view of its rows: the parameters,
their names and the state dict stay as they were, and the memory is not doubled. The joined forward is for
inference only (gradients would reach the views, not the stack), so the loaders join and training does not.
"""

from __future__ import annotations

import torch
from torch import nn


def join_linears(*linears: nn.Module | None) -> torch.Tensor | None:
    """One weight [sum of outputs, inputs] whose row blocks are the linears' weights (now views of it); None
    (nothing changed) unless every one is a plain bias-free ``nn.Linear`` with weights of one dtype and device."""
    if not linears or any(type(linear) is not nn.Linear or linear.bias is not None for linear in linears):
        return None
    weights = [linear.weight for linear in linears]
    if len({(w.dtype, w.device, w.shape[1]) for w in weights}) != 1:
        return None
    with torch.no_grad():
        joined = torch.cat([w.detach() for w in weights])
        start = 0
        for linear, weight in zip(linears, weights, strict=True):
            rows = weight.shape[0]
            linear.weight = nn.Parameter(joined[start : start + rows], requires_grad=False)
            start += rows
    return joined
