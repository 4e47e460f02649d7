"""The truth for the compressors of both variants: softmax(gate)-weighted pooling per channel, then RMSNorm.

``compressor_pool`` is the arithmetic on complete windows, tensors in and out; the prefill's pending-window
bookkeeping (which tokens form a window, the overlap of CSA windows) stays in ``dsinfer.layers.compressor``.
``compressor_decode`` is a whole decode step of a compressor, one token per sequence: the token joins its state
slot's unfinished window, and the window it completes is pooled and normalised. ``compressor_decode_store``
adds V4's RoPE and the write of the completed entry into the sequence's cache block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.norm_rope.reference import rms_norm_reference, rope_reference
from dsinfer.ops.registry import REFERENCE, register


@register("compressor_pool", REFERENCE)
def compressor_pool_reference(
    values: torch.Tensor, gates: torch.Tensor, norm_weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Entries [n, dim] (pre-RoPE) from windows ``values`` / ``gates`` [n, slots, dim].

    Each channel's weights are a softmax over the window's slots, taken in float32 and applied in ``values``'
    dtype (V4 pools in the model dtype, V4.1 in float32); the sum is cast to ``dtype`` and RMS-normalised.
    A slot whose gate is -inf (the missing predecessor of a first CSA window) gets weight 0.
    """
    weights = gates.softmax(dim=1, dtype=torch.float32).to(values.dtype)
    return rms_norm_reference((values * weights).sum(dim=1).to(dtype), norm_weight, eps)


@dataclass(frozen=True)
class CompressorDecodeInputs:
    """One decode token per sequence through its compressor state (shapes: :func:`compressor_decode_reference`)."""

    values: torch.Tensor
    gates: torch.Tensor
    slot_bias: torch.Tensor | None
    positions: torch.Tensor
    slots: torch.Tensor
    window_from: torch.Tensor
    pending_values: torch.Tensor
    pending_gates: torch.Tensor
    previous_values: torch.Tensor | None
    previous_gates: torch.Tensor | None
    norm_weight: torch.Tensor
    eps: float
    dtype: torch.dtype


@dataclass(frozen=True)
class CompressorStoreInputs(CompressorDecodeInputs):
    """A compressor's decode step and V4's store of its completed entries (:func:`compressor_decode_store_reference`):
    the angles ``cos`` / ``sin`` of each window's first position, the ``entries`` pool, the block tables and the
    ``trash`` block that rows of tokens that completed nothing go to."""

    cos: torch.Tensor
    sin: torch.Tensor
    entries: torch.Tensor
    block_tables: torch.Tensor
    trash: int


@register("compressor_decode", REFERENCE)
def compressor_decode_reference(inputs: CompressorDecodeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode token per sequence through its compressor state; returns (latents [B, dim], entry ids [B],
    complete [B]).

    ``values`` / ``gates`` [B, width] are the tokens' projections; ``slot_bias`` [ratio, width] (V4's ``ape``,
    None for V4.1) is added to the gates at the token's slot in its window. Each token's projections go to row
    ``position % ratio`` of its state slot in ``pending_values`` / ``pending_gates`` [slots, ratio, width]. The
    window is pooled whether or not the token completed it: only the rows of tokens that did (``complete``) are
    entries; a backend may leave the others zero. Overlapping compressors (``previous_*`` [slots, ratio, width],
    CSA) pool the previous window's first half (when it lies inside the sequence's window, else weight 0) with
    this window's second half, and a token that completes its window makes it the slot's previous one.
    """
    gates, positions, slots, slot_bias = inputs.gates, inputs.positions, inputs.slots, inputs.slot_bias
    pending_values, pending_gates = inputs.pending_values, inputs.pending_gates
    previous_values, previous_gates = inputs.previous_values, inputs.previous_gates
    ratio = pending_values.shape[1]
    overlap = previous_values is not None
    dim = pending_values.shape[2] // 2 if overlap else pending_values.shape[2]
    offset = positions % ratio
    if slot_bias is not None:
        gates = gates + slot_bias[offset].to(gates.dtype)
    pending_values[slots, offset] = inputs.values.to(pending_values.dtype)
    pending_gates[slots, offset] = gates.to(pending_gates.dtype)
    window_values, window_gates = pending_values[slots], pending_gates[slots]  # [B, ratio, width]
    first = positions - offset
    complete = offset == ratio - 1
    if overlap:
        has_previous = (first >= ratio) & (first - ratio >= inputs.window_from)
        earlier_gates = previous_gates[slots][..., :dim].masked_fill(~has_previous[:, None, None], float("-inf"))
        earlier_values = previous_values[slots][..., :dim] * has_previous[:, None, None]
        pool_values = torch.cat([earlier_values, window_values[..., dim:]], dim=1)
        pool_gates = torch.cat([earlier_gates, window_gates[..., dim:]], dim=1)
        keep = complete[:, None, None]
        previous_values[slots] = torch.where(keep, window_values, previous_values[slots])
        previous_gates[slots] = torch.where(keep, window_gates, previous_gates[slots])
    else:
        pool_values, pool_gates = window_values, window_gates
    latents = compressor_pool_reference(pool_values, pool_gates, inputs.norm_weight, inputs.eps, inputs.dtype)
    return latents, first // ratio, complete


@register("decode_entry_location", REFERENCE)
def decode_entry_location(
    block_tables: torch.Tensor, entry: torch.Tensor, complete: torch.Tensor | None, per_block: int, trash: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, row) of each sequence's decode entry [B] (entry ids >= 0): its block-table block if ``complete``,
    else ``trash``; ``complete`` None: every entry is complete (a ratio-1 source: each token is its entry).

    Fixed shapes and no host read: the destination is chosen on the device, so a CUDA graph can replay it."""
    column = (entry // per_block).clamp(max=block_tables.shape[1] - 1)
    block = block_tables.gather(1, column[:, None]).squeeze(1)
    if complete is None:
        return block, entry % per_block
    return torch.where(complete, block, torch.full_like(block, trash)), entry % per_block


@register("compressor_decode_store", REFERENCE)
def compressor_decode_store_reference(inputs: CompressorStoreInputs) -> None:
    """:func:`compressor_decode_reference`, then V4's store: each completed entry, RoPE'd by ``cos`` / ``sin``
    [B, rope_dim // 2] (the angles of its window's first position), into ``entries`` [blocks, per_block, dim] at
    its block-table block. Rows of tokens that completed nothing go to block ``trash`` (a backend may skip them).
    """
    latents, entry, complete = compressor_decode_reference(inputs)
    entries = inputs.entries
    block, row = decode_entry_location(inputs.block_tables, entry, complete, entries.shape[1], inputs.trash)
    entries[block, row] = rope_reference(latents, inputs.cos, inputs.sin).to(entries.dtype)
