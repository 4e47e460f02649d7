"""The truth for prefill attention: the new tokens of a packed batch over their windows and compressed entries.

Each token of a sequence attends to (a) its sliding window, the ``window_size`` positions up to and including
its own: positions of this step from the new K=V rows ``kv``, earlier ones from the sequence's ring (row
``position % ring_size``), never before ``window_from`` (the oldest position the ring holds after a prefix hit);
(b) compressed entries of its sequence through the block table: the indexer's choice (``indices``, entry
numbers within the sequence, -1 where there is none) in CSA layers, every entry visible at its position
(``(position + 1) // compress_ratio`` of them) in HCA layers. A learned per-head sink joins the denominator.

This is the math the V4 layer's prefill ran inline, kept literally (per sequence, dense logits over blocks of
``QUERY_CHUNK`` queries) so that it stays bit-identical to it; host-known sequence bounds decide its shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsinfer.ops.registry import REFERENCE, register

QUERY_CHUNK = 256  # prefill queries per attention block (window keys per block: QUERY_CHUNK + window - 1)


def sink_softmax(logits: torch.Tensor, sink: torch.Tensor, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probabilities over the keys of ``logits`` [..., H, S, K], a per-head sink [H] in the denominator.

    The sink is one more logit per head that takes probability mass but has no value; ``hidden`` (a boolean
    broadcastable to ``logits``) marks the keys a query may not see. Every attention of both variants (window,
    compressed, decode, DSpark stages) normalises through here.
    """
    if hidden is not None:
        logits = logits.masked_fill(hidden, float("-inf"))
    sink = sink.float().view(-1, 1, 1).expand(*logits.shape[:-1], 1)
    return torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]


def attend_keys(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor | None, sink: torch.Tensor, softmax_scale: float
) -> torch.Tensor:
    """Queries [n, H, D] of one sequence over shared keys [K, D] (``visible`` [n, K]; None: all of them)."""
    logits = torch.einsum("shd,kd->hsk", q, keys).float() * softmax_scale
    hidden = None if visible is None else ~visible.unsqueeze(0)
    probs = sink_softmax(logits, sink, hidden)
    return torch.einsum("hsk,kd->shd", probs.to(keys.dtype), keys)


@dataclass(frozen=True)
class SinkAttention:
    """What every query of a layer attends with: its window length, the per-head sink [H] and the softmax scale."""

    window_size: int
    sink: torch.Tensor
    softmax_scale: float


def attend_window_and_entries(
    q: torch.Tensor,
    positions: torch.Tensor,
    window_kv: torch.Tensor,
    window_positions: torch.Tensor,
    compressed: torch.Tensor | None,
    compressed_visible: torch.Tensor | None,
    scoring: SinkAttention,
) -> torch.Tensor:
    """Softmax attention of one sequence's queries [n, H, D] over its window keys and compressed entries."""
    distance = positions[:, None] - window_positions[None, :]
    window_visible = (distance >= 0) & (distance < scoring.window_size)
    keys, visible = window_kv, window_visible
    if compressed is not None:
        keys = torch.cat([window_kv, compressed.to(window_kv.dtype)])
        visible = torch.cat([window_visible, compressed_visible], dim=1)
    return attend_keys(q, keys, visible, scoring.sink, scoring.softmax_scale)


def attend_in_query_blocks(
    q: torch.Tensor,
    positions: torch.Tensor,
    window: tuple[torch.Tensor, torch.Tensor],
    compressed: torch.Tensor | None,
    compressed_visible: torch.Tensor | None,
    query_start: int,
    first_key: int,
    scoring: SinkAttention,
) -> torch.Tensor:
    """:func:`attend_window_and_entries` over blocks of ``QUERY_CHUNK`` queries, each against only the window
    keys it can see (``window``: the keys and their positions).

    A long prompt's queries see ``window_size`` window keys each; attending every query to every new key costs
    n^2 memory and time. Queries and window keys are consecutive positions (``query_start`` and ``first_key``,
    host-known), so each block's keys are one slice.
    """
    n = q.shape[0]
    window_kv, window_positions = window
    if n <= QUERY_CHUNK:
        return attend_window_and_entries(q, positions, window_kv, window_positions, compressed, compressed_visible,
                                         scoring)  # fmt: skip
    out = []
    for lo in range(0, n, QUERY_CHUNK):
        hi = min(n, lo + QUERY_CHUNK)
        keys_lo = max(first_key, query_start + lo - scoring.window_size + 1) - first_key
        keys_hi = query_start + hi - first_key
        visible = None if compressed_visible is None else compressed_visible[lo:hi]
        out.append(
            attend_window_and_entries(
                q[lo:hi],
                positions[lo:hi],
                window_kv[keys_lo:keys_hi],
                window_positions[keys_lo:keys_hi],
                compressed,
                visible,
                scoring,
            )  # fmt: skip
        )
    return torch.cat(out)


def sequence_entries(entries: torch.Tensor, block_table: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` entries of one sequence [count, D], read through its block table."""
    per_block = entries.shape[1]
    entry_ids = torch.arange(count, device=entries.device)
    return entries[block_table[entry_ids // per_block], entry_ids % per_block]


def chosen_mask(indices: torch.Tensor, count: int) -> torch.Tensor:
    """Boolean [n, count]: the entries ``indices`` [n, K] name (-1: none; they land in a dropped last column)."""
    mask = torch.zeros(indices.shape[0], count + 1, dtype=torch.bool, device=indices.device)
    columns = torch.where(indices >= 0, indices, count)
    return mask.scatter_(1, columns, True)[:, :count]


@dataclass(frozen=True)
class SparsePrefillInputs:
    """One prefill step of sparse attention: every new token of a packed batch over its window and entries.

    q [T, H, D] (RoPE'd); kv [T, D] the new K=V rows (RoPE'd); positions [T]; sequence_rows [B + 1] the packed
    row each sequence starts at (the last is T); starts [B] the position of each sequence's first new token
    (its positions run consecutively from there); slots, window_from [B]; window [slots, R, D] the rings,
    holding the positions before ``starts`` (this step's rows not yet written); entries [blocks, per_block, D]
    or None (a window-only layer); block_tables [B, max_blocks]; indices [T, K] (CSA: entry numbers, -1 where
    none) or None (HCA: every visible entry); sink [H] float32. ``spans`` are the host-known (start, length,
    window_from) of each sequence, the values of ``starts``, ``sequence_rows`` and ``window_from``: they decide
    the reference's shapes without a device read (the kernels read the tensors and never ``spans``).
    """

    q: torch.Tensor
    kv: torch.Tensor
    positions: torch.Tensor
    sequence_rows: torch.Tensor
    starts: torch.Tensor
    slots: torch.Tensor
    window_from: torch.Tensor
    window: torch.Tensor
    window_size: int
    entries: torch.Tensor | None
    block_tables: torch.Tensor
    indices: torch.Tensor | None
    compress_ratio: int
    sink: torch.Tensor
    softmax_scale: float
    spans: Sequence[tuple[int, int, int]] = ()


@register("sparse_attention_prefill", REFERENCE)
def sparse_attention_prefill_reference(inputs: SparsePrefillInputs) -> torch.Tensor:
    """Attention of every new token of a packed batch; returns [T, H, D] in ``q.dtype`` (shapes and ``spans``:
    :class:`SparsePrefillInputs`)."""
    q, kv, positions, window, entries, indices = (inputs.q, inputs.kv, inputs.positions, inputs.window,
                                                  inputs.entries, inputs.indices)  # fmt: skip
    window_size, compress_ratio = inputs.window_size, inputs.compress_ratio
    scoring = SinkAttention(window_size, inputs.sink, inputs.softmax_scale)
    ring_size = window.shape[1]
    outputs = []
    row_hi = 0
    for seq, (start, length, oldest) in enumerate(inputs.spans):
        row_lo, row_hi = row_hi, row_hi + length
        seq_positions, seq_kv = positions[row_lo:row_hi], kv[row_lo:row_hi]
        first_key = max(oldest, start - window_size + 1)
        cached_positions = torch.arange(first_key, start, device=kv.device)
        ring = window.index_select(0, inputs.slots[seq : seq + 1])[0]  # the slot's ring, its number never read here
        window_kv = torch.cat([ring[cached_positions % ring_size].to(kv.dtype), seq_kv])
        window_positions = torch.cat([cached_positions, seq_positions])
        compressed, visible = None, None
        if entries is not None:
            count = (start + row_hi - row_lo) // compress_ratio
            compressed = sequence_entries(entries, inputs.block_tables[seq], count)
            if indices is not None:
                visible = chosen_mask(indices[row_lo:row_hi], count)
            else:
                entry = torch.arange(count, device=kv.device)
                visible = entry < torch.div(seq_positions + 1, compress_ratio, rounding_mode="floor")[:, None]
        outputs.append(
            attend_in_query_blocks(
                q[row_lo:row_hi],
                seq_positions,
                (window_kv, window_positions),
                compressed,
                visible,
                start,
                first_key,
                scoring,
            )  # fmt: skip
        )
    if not outputs:
        return torch.empty_like(q)
    return torch.cat(outputs)
