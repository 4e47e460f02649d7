"""A grouped projection (the attention's ``wo_a``): the weight's rows and the input's columns cut into ``groups``
equal runs, each run of output columns its own run of input columns times its own rows of the weight.

On CUDA outside autograd it is one batched GEMM written straight into the ``[T, groups, rows]`` layout (an
einsum's ``[groups, T, rows]`` result would be copied into it: 0.34 ms of a 4,096-token chunk on the slice);
elsewhere (the CPU, where the strided output is no cheaper, and autograd, which has no ``out=``) an einsum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """``x`` [..., groups * in] and ``weight`` [groups * out, in] -> [..., groups * out] (``F.linear`` at 1)."""
    if groups == 1:
        return F.linear(x, weight)
    lead, inputs = x.shape[:-1], weight.shape[1]
    grouped = x.reshape(-1, groups, inputs)
    per_group = weight.view(groups, -1, inputs)
    if x.is_cuda and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        mixed = torch.empty(grouped.shape[0], groups, per_group.shape[1], dtype=x.dtype, device=x.device)
        torch.bmm(grouped.transpose(0, 1), per_group.transpose(1, 2), out=mixed.transpose(0, 1))
    else:
        mixed = torch.einsum("tgi,goi->tgo", grouped, per_group)
    return mixed.reshape(*lead, weight.shape[0])
