"""A row chain not run yet: ``rope_and_round``'s arguments and the op table to run them with, handed from a layer
to the cache write that stores the rows, so the write can run the chain and the store as one op
(``rope_round_store``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from dsinfer.ops.rope_round.reference import RopeRoundStoreInputs


class RowChain(NamedTuple):
    """``ops.rope_and_round(x, cos, sin, weight, eps, rounding, block)`` not run yet: the rows it would give are
    ``x.shape`` and ``x.dtype``."""

    ops: Any  # the layer's OpTable
    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    weight: torch.Tensor | None
    eps: float
    rounding: str | None
    block: int

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def arguments(self) -> tuple:
        """``rope_and_round``'s arguments (what ``rope_round_store`` takes before the pool's)."""
        return tuple(self)[1:]

    def rows(self) -> torch.Tensor:
        """The chain's rows (a new tensor)."""
        return self.ops.rope_and_round(*self.arguments)

    def store(self, *pool) -> None:
        """The rows written as ``cache_store(rows, *pool)`` would write them, in one op."""
        self.ops.rope_round_store(RopeRoundStoreInputs(*self.arguments, *pool))
