"""The truth for decode attention over V4.1's coded cache: decode what the step reads, then V4's decode attention.

The window ring is FP8 e4m3 codes ``[slots, W, D]`` with a ue8m0 exponent byte per ``D / window_scales.shape[-1]``
channels; entries are packed FP4 e2m1 ``[blocks, per_block, D / 2]`` with an e4m3 scale per
``D / entry_scales.shape[-1]`` channels (the formats of :mod:`dsinfer.kv.codecs`). Decoding is exact, so the result
is :func:`~dsinfer.ops.sparse_attention.reference.sparse_attention_decode_reference` over the decoded rows: the
sequences' rings, and their chosen entries laid out as one block per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.cache_codec.reference import cache_decode_reference
from dsinfer.ops.registry import REFERENCE, register
from dsinfer.ops.sparse_attention.reference import SparseDecodeInputs, StepRows, sparse_attention_decode_reference


def _rows(codes: torch.Tensor, scales: torch.Tensor, index: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of codes and scales, indexed through byte views (float8 advanced indexing is missing on some devices)."""
    return codes.view(torch.uint8)[index].view(codes.dtype), scales.view(torch.uint8)[index].view(scales.dtype)


@dataclass(frozen=True)
class CodedDecodeInputs:
    """One decode step of sparse attention over V4.1's coded cache: V4's :class:`SparseDecodeInputs` with the window
    ring as e4m3 ``window_codes`` [slots, R, D] and ue8m0 ``window_scales``, and the entries as packed e2m1
    ``entry_codes`` [blocks, per_block, D / 2] and e4m3 ``entry_scales`` (both None: a window-only layer).
    ``step``: a verify step's rows not in the ring yet, as e4m3 codes [N, D] with their ue8m0 ``scales``
    (:class:`StepRows`)."""

    q: torch.Tensor
    window_codes: torch.Tensor
    window_scales: torch.Tensor
    slots: torch.Tensor
    positions: torch.Tensor
    window_from: torch.Tensor
    entry_codes: torch.Tensor | None
    entry_scales: torch.Tensor | None
    block_tables: torch.Tensor
    indices: torch.Tensor | None
    sink: torch.Tensor
    softmax_scale: float
    step: StepRows | None = None


@register("sparse_attention_decode_coded", REFERENCE)
def sparse_attention_decode_coded_reference(inputs: CodedDecodeInputs) -> torch.Tensor:
    """Attention of one query per sequence, [B, H, D] in ``q.dtype``: V4's decode contract with a coded cache."""
    q, indices, entry_codes, block_tables = inputs.q, inputs.indices, inputs.entry_codes, inputs.block_tables
    positions, window_from, sink, softmax_scale = (
        inputs.positions,
        inputs.window_from,
        inputs.sink,
        inputs.softmax_scale,
    )
    batch, head_dim = q.shape[0], q.shape[-1]
    codes, scales = _rows(inputs.window_codes, inputs.window_scales, (inputs.slots,))
    ring = cache_decode_reference(codes, scales, "e4m3", head_dim // scales.shape[-1], "ue8m0", q.dtype)
    local = torch.arange(batch, device=q.device)
    step = inputs.step
    if step is not None:  # the step's rows decoded as the ring's
        rows = cache_decode_reference(step.rows, step.scales, "e4m3", head_dim // step.scales.shape[-1], "ue8m0",
                                      q.dtype)  # fmt: skip
        step = StepRows(rows, step.starts, step.first_rows)
    if entry_codes is None or indices is None or indices.shape[1] == 0:
        return sparse_attention_decode_reference(
            SparseDecodeInputs(q, ring, local, positions, window_from, None, block_tables, None, sink, softmax_scale,
                               step=step)
        )  # fmt: skip
    per_block, count = entry_codes.shape[1], indices.shape[1]
    safe = indices.clamp(min=0)
    blocks = block_tables.gather(1, torch.div(safe, per_block, rounding_mode="floor"))
    codes, scales = _rows(entry_codes, inputs.entry_scales, (blocks, safe.remainder(per_block)))
    entries = cache_decode_reference(codes, scales, "e2m1", head_dim // scales.shape[-1], "e4m3", q.dtype)
    # The decoded entries as a pool of one block per sequence, [B, K, D], and their numbers in it.
    own = torch.where(indices >= 0, torch.arange(count, device=q.device), -1)
    return sparse_attention_decode_reference(
        SparseDecodeInputs(q, ring, local, positions, window_from, entries, local[:, None], own, sink, softmax_scale,
                           step=step)
    )  # fmt: skip
