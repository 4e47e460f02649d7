"""Top-k selection with exact ties broken by the lowest index, in every backend.

``torch.topk`` breaks ties in an order that depends on the row's width and the device, so a selection made
over a prefill chunk of one width could differ from the same selection made over another. The indexer's
ReLU scores tie at exactly 0 often, expert scores can tie, candidate blocks tie; every top-k of the models
goes through :func:`topk_indices` so the choice depends on the values alone.
"""

from dsinfer.ops.topk.packed_key import topk_indices_packed_key
from dsinfer.ops.topk.reference import topk_indices_reference

__all__ = ["topk_indices", "topk_indices_packed_key", "topk_indices_reference"]


def topk_indices(scores, k: int):
    """Indices [..., k] of the ``k`` largest ``scores`` along the last axis, best first, ties -> lowest index."""
    return topk_indices_packed_key(scores, k)
