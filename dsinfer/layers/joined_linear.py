"""Linears that read the same input, joined into one GEMM for inference.

At a decode step of a few tokens a GEMM is a launch (often two, with cuBLAS's split-K reduction) for a few MiB
of weights, so two projections of the same input cost more as two GEMMs than as one over their stacked weights.
:func:`join_linears` stacks the weights once and makes each linear's weight a view of its rows: the parameters,
their names and the state dict stay as they were, and the memory is not doubled. The joined forward is for
inference only (gradients would reach the views, not the stack), so the loaders join and training does not.
:class:`JoinedLinears` does the same for named groups of linears (an attention's projections of its input), one
GEMM whose column slices go to each group's consumer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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


def joined_views(joined: torch.Tensor | None, *linears: nn.Module) -> bool:
    """Whether the linears' weights are still consecutive row blocks of ``joined`` (what :func:`join_linears` left):
    joining again would only make a second stack."""
    if joined is None or any(type(linear) is not nn.Linear for linear in linears):
        return False
    start = 0
    for linear in linears:
        weight = linear.weight
        rows = weight.shape[0]
        if weight.untyped_storage().data_ptr() != joined.untyped_storage().data_ptr():
            return False
        if start + rows > joined.shape[0] or weight.data_ptr() != joined[start].data_ptr():
            return False
        if weight.shape != joined[start : start + rows].shape or weight.stride() != joined.stride():
            return False
        start += rows
    return start == joined.shape[0]


def _joinable(linear: nn.Module) -> bool:
    return type(linear) is nn.Linear and linear.bias is None


class JoinedLinears:
    """Named groups of linears that read one input, stacked into one weight (each linear's weight a view of its
    rows): one GEMM gives every group's output, a view of its columns (the consumers read row strides).

    Not a module: the stack is no parameter or buffer, so the state dict keeps only the linears' own names.
    """

    def __init__(self, weight: torch.Tensor, groups: dict[str, tuple[nn.Module, ...]]) -> None:
        self.weight, self.groups = weight, groups
        self.names = list(groups)
        self.rows = [sum(linear.weight.shape[0] for linear in linears) for linears in groups.values()]
        self.offsets = [sum(self.rows[:index]) for index in range(len(self.rows) + 1)]

    @classmethod
    def join(
        cls, groups: dict[str, tuple[nn.Module | None, ...]], previous: JoinedLinears | None = None
    ) -> JoinedLinears | None:
        """Stack the groups whose linears are plain bias-free ``nn.Linear`` of the first such group's dtype,
        device and input width, in the given order; None (nothing changed) when fewer than two groups qualify.

        ``previous`` (an earlier join of these groups) is kept when the weights are still its views: joining
        twice makes no second stack."""
        kept: dict[str, tuple[nn.Module, ...]] = {}
        key = None
        for name, linears in groups.items():
            if not linears or not all(linear is not None and _joinable(linear) for linear in linears):
                continue
            kinds = {(linear.weight.dtype, linear.weight.device, linear.weight.shape[1]) for linear in linears}
            if len(kinds) != 1 or (key is not None and kinds != {key}):
                continue
            key = next(iter(kinds))
            kept[name] = tuple(linears)
        if len(kept) < 2:
            return None
        linears = [linear for group in kept.values() for linear in group]
        if previous is not None and previous.groups == kept and joined_views(previous.weight, *linears):
            return previous
        return cls(join_linears(*linears), kept)

    def group_weight(self, name: str) -> torch.Tensor:
        """The stacked rows of one group (a view of the stack)."""
        index = self.names.index(name)
        return self.weight[self.offsets[index] : self.offsets[index + 1]]

    def __call__(self, x: torch.Tensor, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """Every group's output (a view of one GEMM's columns); with ``names``, the GEMM covers only the run of
        groups from the first to the last of them that are joined (the groups in between come too)."""
        wanted = self.names if names is None else [name for name in names if name in self.groups]
        if not wanted:
            return {}
        present = [self.names.index(name) for name in wanted]
        first, last = min(present), max(present) + 1
        out = F.linear(x, self.weight[self.offsets[first] : self.offsets[last]])
        return dict(zip(self.names[first:last], out.split(self.rows[first:last], dim=-1), strict=True))
