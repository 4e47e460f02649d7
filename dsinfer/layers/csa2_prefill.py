"""What V4.1's prefill attention hands ``sparse_attention_prefill``: the cache's windows and entries in the op's layout.

The op reads a window ring per sequence (``[slots, ring, head_dim]`` in the model dtype, row ``position % ring``)
and compressed entries through block tables (``[blocks, per_block, head_dim]``), and takes the indexer's choice as
entry numbers per token, -1 where there is none. A V4.1 cache keeps windows and entries in the model dtype, or
(``quantized_storage``) as FP8 / FP4 codes plus scales:

* **windows**: model-dtype rings are the op's layout already (the cache's tensor, the step's slots); coded rings
  are decoded for the batch's slots only, into ``[B, ring, head_dim]`` read through slots ``0 .. B - 1``, and
  only when some sequence reads a cached position at all (a batch of fresh prompts decodes nothing);
* **entries** of the KV source a layer reuses: the cache's tensor and the step's block tables in model-dtype
  storage; coded entries are decoded for the blocks the step's tables name only, read through a table of
  their own. Both give the values the per-sequence reads (:meth:`~dsinfer.kv.cache_v41.KVCacheV41.read_entries`)
  give, bit for bit: decoding is row by row.

Every choice here is made from host-known spans and shapes: no device value is read on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.kv.batch import DeviceSpans, PackedBatch, SequenceSpan, host_to_device
from dsinfer.kv.cache_v41 import KVCacheV41


def candidate_block_rows(mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """The candidate blocks [n, ceil(W / block_size)] of an entry mask [n, W] that keeps or drops whole blocks
    (``candidate_block_mask``'s): each block's first entry, ``block_size`` times fewer bytes to keep."""
    return mask[:, ::block_size].contiguous()


def candidate_entries(blocks: torch.Tensor, block_size: int, width: int) -> torch.Tensor:
    """The entry mask [n, width] of candidate blocks [n, ceil(width / block_size)]: every entry of a kept block."""
    return blocks.repeat_interleave(block_size, dim=-1)[:, :width]


def packed_indices(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Per-sequence entry numbers [n_i, k_i] as one [T, max k_i] (-1 padding), rows in packed order."""
    width = max(piece.shape[1] for piece in pieces)
    return torch.cat([F.pad(piece, (0, width - piece.shape[1]), value=-1) for piece in pieces])


def reads_ring(spans: list[SequenceSpan], window: int) -> bool:
    """Whether any sequence's window holds a position before its step (one the ring has to give)."""
    return any(max(span.window_from, span.start - window + 1) < span.start for span in spans)


def window_view(
    cache: KVCacheV41, layer_id: int, device_spans: DeviceSpans, spans: list[SequenceSpan], window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rings the op reads (model dtype) and the slot of each sequence in them, [B].

    Model-dtype storage: the cache's rings and the step's slots. Coded storage: the batch's rings decoded
    ([B, ring, head_dim], slots 0 .. B - 1), left undecoded (uninitialised, never read) when no sequence reads
    a cached position."""
    ring = cache.layers[layer_id].window
    if cache.window_format is None:
        return ring, device_spans.slots
    count, size, device = len(spans), ring.shape[1], ring.device
    local_slots = torch.arange(count, device=device)
    if not reads_ring(spans, window):
        return torch.empty(count, size, cache.config.head_dim, dtype=cache.dtype, device=device), local_slots
    rows = torch.arange(size, device=device)
    return cache.read_window(layer_id, device_spans.slots[:, None], rows[None, :]), local_slots


def entries_view(cache: KVCacheV41, source_layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A KV source's entries as the op reads them (model dtype, [blocks, per_block, head_dim]) and the block
    tables [B, max_blocks] to read them through.

    Model-dtype storage: the cache's entries and ``block_tables`` (the step's). Coded storage: the blocks the
    tables name (padding included: the trash block), decoded, in table order."""
    source = cache.layers[source_layer].source
    fmt = cache.entry_format
    if fmt is None:
        return source.entries, block_tables
    codes = source.entries.view(torch.uint8)[block_tables].view(source.entries.dtype)
    scales = source.entry_scales.view(torch.uint8)[block_tables].view(source.entry_scales.dtype)
    dense = fmt.decode(codes, scales, cache.dtype, cache.ops).flatten(0, 1)  # [B * max_blocks, per_block, D]
    tables = torch.arange(block_tables.numel(), device=block_tables.device).view(block_tables.shape)
    return dense, tables


def write_windows(cache: KVCacheV41, layer_id: int, kv: torch.Tensor, batch: PackedBatch, window: int) -> None:
    """The newest ``window`` new rows of every sequence into its ring, in one write through the cache's codec."""
    rows, slots = [], []
    for span, tokens in zip(batch.spans, batch.sequence_slices(), strict=True):
        recent = range(max(tokens.start, tokens.stop - window), tokens.stop)
        rows.extend(recent)
        slots.extend([span.slot] * len(recent))
    rows = host_to_device(rows, torch.long, kv.device)
    slots = host_to_device(slots, torch.long, kv.device)
    cache.write_window(layer_id, slots, batch.positions[rows], kv[rows])
