"""The truth for decode attention: one query token per sequence over its window ring and compressed entries.

Keys are the ``window`` ring rows of the sequence (oldest position first), then the compressed entries named by
``indices``; one 512-d vector per key serves as key and value (shared-KV MQA: every query head reads it). A key
the sequence may not see (before position 0, before ``window_from``, or an index of -1) is masked. The learned
per-head sink joins the softmax denominator only. This is the math the V4 layer's decode step ran inline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.registry import REFERENCE, register


@dataclass(frozen=True)
class StepRows:
    """A verify step's window rows that are not in the ring yet (the ring still holds the window before the step,
    which every query of the step reads): ``rows`` [N, D] (in coded storage: codes, with ``scales``), each query's
    first step position ``starts`` [B] (keys at or after it come from ``rows``) and the row of ``rows`` holding it,
    ``first_rows`` [B]; the query's sequence's later positions follow in the next rows."""

    rows: torch.Tensor
    starts: torch.Tensor
    first_rows: torch.Tensor
    scales: torch.Tensor | None = None


def window_keys(
    window: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    window_from: torch.Tensor,
    step: StepRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring rows of every sequence, oldest position first ([B, W, D]), and which of them it may see ([B, W]).

    ``step``: the positions from each query's ``step.starts`` on are read from ``step.rows`` instead of the
    ring."""
    size = window.shape[1]
    key_positions = positions[:, None] - size + 1 + torch.arange(size, device=positions.device)
    keys = window[slots[:, None], key_positions.remainder(size)]
    if step is not None:
        offsets = key_positions - step.starts[:, None]
        from_step = offsets >= 0
        rows = (step.first_rows[:, None] + offsets).clamp(0, step.rows.shape[0] - 1)
        keys = torch.where(from_step[..., None], step.rows[rows].to(keys.dtype), keys)
    visible = (key_positions >= 0) & (key_positions >= window_from[:, None])
    return keys, visible


def entry_keys(entries: torch.Tensor, block_tables: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Entries ``indices`` [B, K] (entry numbers within each sequence's block table) of the pool, [B, K, D].

    An index of -1 reads entry 0 of the sequence's table instead; callers mask it.
    """
    per_block = entries.shape[1]
    safe = indices.clamp(min=0)
    blocks = block_tables.gather(1, torch.div(safe, per_block, rounding_mode="floor"))
    return entries[blocks, safe.remainder(per_block)]


@dataclass(frozen=True)
class SparseDecodeInputs:
    """One decode step of sparse attention: one query token per sequence over its window ring and entries.

    q [B, H, D]; window [slots, R, D], a ring of R >= W rows (this step's token already written at
    ``positions % R``); slots, positions, window_from [B] int64; entries [blocks, per_block, D] (or None: a
    window-only layer); block_tables [B, max_blocks]; indices [B, K] int64, -1 where there is no entry (or None);
    sink [H] float32. ``step``: a verify step's rows, read from there instead of the ring (:class:`StepRows`;
    None: every position is in the ring).
    """

    q: torch.Tensor
    window: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    window_from: torch.Tensor
    entries: torch.Tensor | None
    block_tables: torch.Tensor
    indices: torch.Tensor | None
    sink: torch.Tensor
    softmax_scale: float
    step: StepRows | None = None


@register("sparse_attention_decode", REFERENCE)
def sparse_attention_decode_reference(inputs: SparseDecodeInputs) -> torch.Tensor:
    """Attention of one query per sequence; returns [B, H, D] in ``q.dtype`` (shapes: :class:`SparseDecodeInputs`)."""
    q, window, entries, indices = inputs.q, inputs.window, inputs.entries, inputs.indices
    keys, visible = window_keys(window, inputs.slots, inputs.positions, inputs.window_from, inputs.step)
    keys = keys.to(q.dtype)
    if entries is not None and indices is not None:
        keys = torch.cat([keys, entry_keys(entries, inputs.block_tables, indices).to(keys.dtype)], dim=1)
        visible = torch.cat([visible, indices >= 0], dim=1)
    logits = torch.einsum("bhd,bkd->bhk", q, keys).float() * inputs.softmax_scale
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    sink = inputs.sink.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
    probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]
    return torch.einsum("bhk,bkd->bhd", probs.to(keys.dtype), keys)
