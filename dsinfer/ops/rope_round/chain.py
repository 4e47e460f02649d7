"""A row chain not run yet: ``rope_and_round``'s arguments and the op table to run them with, handed from a layer
to the cache write that stores the rows, so the write can run the chain and the store as one op
(``rope_round_store``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from dsinfer.ops.rope_round.reference import RopeRoundInputs, RopeRoundStoreInputs


class RowChain(NamedTuple):
    """``ops.rope_and_round(inputs)`` not run yet: the rows it would give are ``inputs.x.shape`` and
    ``inputs.x.dtype``."""

    ops: Any  # the layer's OpTable
    inputs: RopeRoundInputs

    @property
    def shape(self) -> torch.Size:
        return self.inputs.x.shape

    def rows(self) -> torch.Tensor:
        """The chain's rows (a new tensor)."""
        return self.ops.rope_and_round(self.inputs)

    def store(self, *pool) -> None:
        """The rows written as ``cache_store(CacheStoreInputs(rows, *pool))`` would write them, in one op."""
        self.ops.rope_round_store(RopeRoundStoreInputs.of(self.inputs, *pool))
