"""A fixed-width speculative step's index plans: ``step_entry_index`` (the compressed entries a step may write),
``step_ring_rows`` (its positions' rows in the window rings) and ``step_pending_plan`` (where the rollback of
unfinished compressor windows reads and writes); reference (torch) and Triton (CUDA, one launch each)."""

from dsinfer.ops.step_plan import triton  # noqa: F401  (registers the Triton backends)
from dsinfer.ops.step_plan.reference import (
    EntryIndex,
    PendingPlan,
    entries_per_row,
    step_entry_index_reference,
    step_pending_plan_reference,
    step_ring_rows_reference,
)

__all__ = [
    "EntryIndex",
    "PendingPlan",
    "entries_per_row",
    "step_entry_index_reference",
    "step_pending_plan_reference",
    "step_ring_rows_reference",
]
