"""A fixed-width speculative step's index plans: ``step_entry_index`` (the compressed entries a step may write),
``step_ring_rows`` (its positions' rows in the window rings), ``step_pending_plan`` (where the rollback of
unfinished compressor windows reads and writes) and ``step_engram_lookback`` (a rollback's V4.1 Engram look-back);
reference (torch) and Triton (CUDA, one launch each)."""

from dsinfer.ops.step_plan import triton  # noqa: F401  (registers the Triton backends)
from dsinfer.ops.step_plan.reference import (
    EntryIndex,
    PendingPlan,
    entries_per_row,
    step_engram_lookback_reference,
    step_entry_index_reference,
    step_pending_plan_reference,
    step_ring_rows_reference,
)

__all__ = [
    "EntryIndex",
    "PendingPlan",
    "entries_per_row",
    "step_engram_lookback_reference",
    "step_entry_index_reference",
    "step_pending_plan_reference",
    "step_ring_rows_reference",
]
