"""``sinkhorn(comb, iterations, eps)``: mHC's projection of [T, n, n] mixing matrices onto doubly-stochastic ones."""

from dsinfer.ops.sinkhorn import triton  # noqa: F401  (registers the backend)
from dsinfer.ops.sinkhorn.reference import sinkhorn_reference

__all__ = ["sinkhorn_reference"]
