"""Linears that read the same input, joined into one GEMM for inference.

At a decode step of a few tokens a GEMM is a launch (often two, with cuBLAS's split-K reduction) for a few MiB
of weights, so two projections of the same input cost more as two GEMMs than as one over their stacked weights.
:func:`join_linears` stacks the weights once and makes each linear's weight a view of its rows: the parameters,
their names and the state dict stay as they were, and the memory is not doubled. The joined forward is for
inference only (gradients would reach the views, not the stack), so the loaders join and training does not.
:class:`JoinedLinears` does the same for named groups of linears (an attention's projections of its input), one
GEMM whose column slices go to each group's consumer; FP8 linears kept as stored stack their codes and scales
(:class:`~dsinfer.layers.fp8_linear.Fp8Stack`) in a GEMM of their own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.layers.fp8_linear import Fp8Linear, Fp8Stack


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


def _kind(linears: tuple[nn.Module | None, ...]) -> tuple | None:
    """What a group's linears must share to join a stack: plain bias-free ``nn.Linear`` of one dtype, device and
    input width, or :class:`~dsinfer.layers.fp8_linear.Fp8Linear` of one block, compute dtype, device and input
    width with whole scale blocks of rows; None when the group can join no stack."""
    if not linears or any(linear is None for linear in linears):
        return None
    if all(type(linear) is nn.Linear and linear.bias is None for linear in linears):
        kinds = {("plain", linear.weight.dtype, linear.weight.device, linear.weight.shape[1]) for linear in linears}
    elif all(type(linear) is Fp8Linear and linear.out_features % linear.block[0] == 0 for linear in linears):
        kinds = {
            ("fp8", linear.block, linear.compute_dtype, linear.codes.device, linear.in_features) for linear in linears
        }
    else:
        return None
    return next(iter(kinds)) if len(kinds) == 1 else None


class _Stack:
    """One joined weight (a tensor, or an :class:`Fp8Stack`) and the named groups of its rows, in order."""

    def __init__(self, weight: torch.Tensor | Fp8Stack, groups: dict[str, tuple[nn.Module, ...]]) -> None:
        self.weight, self.groups, self.names = weight, groups, list(groups)
        self.rows = [sum(linear.out_features for linear in linears) for linears in groups.values()]
        self.offsets = [sum(self.rows[:index]) for index in range(len(self.rows) + 1)]

    @classmethod
    def join(cls, groups: dict[str, tuple[nn.Module, ...]], previous: _Stack | None) -> _Stack:
        linears = [linear for group in groups.values() for linear in group]
        if previous is not None and previous.groups == groups and previous.holds(linears):
            return previous
        fp8 = type(linears[0]) is Fp8Linear
        return cls(Fp8Stack.join(*linears) if fp8 else join_linears(*linears), groups)

    def holds(self, linears: list[nn.Module]) -> bool:
        if isinstance(self.weight, Fp8Stack):
            return self.weight.holds(*linears)
        return joined_views(self.weight, *linears)

    def __call__(self, x: torch.Tensor, wanted: list[str]) -> dict[str, torch.Tensor]:
        present = [self.names.index(name) for name in wanted if name in self.groups]
        if not present:
            return {}
        first, last = min(present), max(present) + 1
        start, stop = self.offsets[first], self.offsets[last]
        if isinstance(self.weight, Fp8Stack):
            out = self.weight(x, start, stop)
        else:
            out = F.linear(x, self.weight[start:stop])
        return dict(zip(self.names[first:last], out.split(self.rows[first:last], dim=-1), strict=True))


class JoinedLinears:
    """Named groups of linears that read one input, stacked by kind (plain weights in one stack, FP8 kept as
    stored in another; each linear's weight a view of its stack's rows): one GEMM a stack gives every group's
    output, a view of its columns (the consumers read row strides).

    Not a module: the stacks are no parameters or buffers, so the state dict keeps only the linears' own names.
    """

    def __init__(self, stacks: list[_Stack]) -> None:
        self.stacks = stacks
        self.groups = {name: group for stack in stacks for name, group in stack.groups.items()}
        self.names = list(self.groups)

    @classmethod
    def join(
        cls, groups: dict[str, tuple[nn.Module | None, ...]], previous: JoinedLinears | None = None
    ) -> JoinedLinears | None:
        """Stack the groups by kind (see :func:`_kind`), each stack in the given order; a kind with a single
        group stays on its own. None (nothing changed) when no kind has two groups.

        ``previous`` (an earlier join of these groups) is kept when the weights are still its views: joining
        twice makes no second stack."""
        by_kind: dict[tuple, dict[str, tuple[nn.Module, ...]]] = {}
        for name, linears in groups.items():
            kind = _kind(tuple(linears))
            if kind is not None:
                by_kind.setdefault(kind, {})[name] = tuple(linears)
        kept = [kind_groups for kind_groups in by_kind.values() if len(kind_groups) >= 2]
        if not kept:
            return None
        earlier = {tuple(stack.names): stack for stack in previous.stacks} if previous is not None else {}
        stacks = [_Stack.join(kind_groups, earlier.get(tuple(kind_groups))) for kind_groups in kept]
        if previous is not None and [id(stack) for stack in stacks] == [id(stack) for stack in previous.stacks]:
            return previous
        return cls(stacks)

    @property
    def weight(self) -> torch.Tensor | None:
        """The plain stack's joined weight (None when every stack is FP8)."""
        plain = [stack.weight for stack in self.stacks if not isinstance(stack.weight, Fp8Stack)]
        return plain[0] if plain else None

    def group_weight(self, name: str) -> torch.Tensor:
        """The stacked rows of one group of a plain stack (a view of the stack)."""
        for stack in self.stacks:
            if name in stack.groups and not isinstance(stack.weight, Fp8Stack):
                index = stack.names.index(name)
                return stack.weight[stack.offsets[index] : stack.offsets[index + 1]]
        raise KeyError(f"{name!r} is in no plain stack")

    def __call__(self, x: torch.Tensor, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """Every group's output (a view of its stack's GEMM columns); with ``names``, each stack's GEMM covers only
        the run of its groups from the first to the last of them (the groups in between come too)."""
        wanted = self.names if names is None else [name for name in names if name in self.groups]
        out: dict[str, torch.Tensor] = {}
        for stack in self.stacks:
            out.update(stack(x, wanted))
        return out
