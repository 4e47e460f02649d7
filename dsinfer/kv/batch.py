"""The packed batch the model's forward takes: new tokens of many sequences laid end to end, plus metadata.

Each sequence contributes the tokens it has not run yet (a whole prompt, a prefill chunk, or one decode
token) and a :class:`SequenceSpan` saying where they start, which state slot and blocks of the
:class:`~dsinfer.kv.cache_v4.KVCache` hold its earlier tokens. A whole prompt with no engine around is
the special case of a fresh scratch cache and spans that start at 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from dsinfer.kv.cache_v4 import KVCache
from dsinfer.kv.cache_v41 import KVCacheV41

if TYPE_CHECKING:
    from dsinfer.kv.fixed_width import FixedWidthBatch, PendingJournal


@dataclass
class SequenceSpan:
    start: int  # position of the first new token; positions before it are already in the cache
    length: int  # number of new tokens in this batch
    slot: int  # the sequence's state slot (window ring, unfinished compressor windows)
    block_table: list[int] | tuple[int, ...]  # blocks holding compressed entries, in position order
    reuse_below: int = 0  # entries of windows ending at or before this position are stored already (prefix hit)
    window_from: int = 0  # oldest position whose window KV is in the ring (later than 0 after a prefix hit)
    # V4.1 bounded (CED) prefill: positions below this run only the encoder layers and the first decoder layer's
    # compressor; the decoder layers run from here on, their windows starting here (0: every position runs them).
    decoder_from: int = 0
    # Speculative verify spans: the compressors record (cache, first position, values, gates) of their update
    # here, so rejected drafts can be rolled back (dsinfer.speculative.rollback); None: nothing recorded.
    journal: list | None = field(default=None, repr=False, compare=False)
    # Names ``block_table`` while it only grows (the sequence's ``table_token``); None: unknown, always restaged.
    table_token: int | None = field(default=None, repr=False, compare=False)


def host_to_device(values: list | np.ndarray, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list (or numpy array) as a device tensor without a host synchronisation (pinned memory, asynchronous
    copy).

    ``torch.tensor(values, device="cuda")`` copies from pageable memory and waits for the stream; metadata built
    every step must not make the host wait for the GPU, or the scheduler could never run ahead of it.
    """
    device = torch.device(device)
    return _staged(values, dtype, device.type == "cuda").to(device, non_blocking=True)


def _staged(values: list | np.ndarray, dtype: torch.dtype, cuda: bool) -> torch.Tensor:
    """``values`` as a host tensor, pinned when bound for a CUDA device (so its copy need not wait)."""
    host = torch.from_numpy(values).to(dtype) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=dtype)
    return host.pin_memory() if cuda else host


def host_into_device(target: torch.Tensor, values: list) -> torch.Tensor:
    """Write the host list ``values`` into ``target`` (contiguous, as many elements) in one asynchronous copy,
    as :func:`host_to_device` sends it, but into a buffer that stays (a graph's inputs); returns ``target``."""
    host = _staged(values, target.dtype, target.is_cuda)
    if host.numel() != target.numel() or not target.is_contiguous():
        raise ValueError(f"{host.numel()} values for a target of {target.numel()} elements, or one not contiguous")
    return target.copy_(host.view(target.shape), non_blocking=True)


@dataclass
class DeviceSpans:
    """Every span of a batch as device tensors, built once per step and read by every layer."""

    slots: torch.Tensor  # [B] state slot of each sequence
    starts: torch.Tensor  # [B] position of each sequence's first new token
    window_from: torch.Tensor  # [B] oldest position whose window KV is in the ring
    block_tables: torch.Tensor  # [B, max_blocks], padded with the cache's trash block
    token_rows: torch.Tensor  # [B] row of each sequence's last new token in the packed tensors

    @property
    def max_blocks(self) -> int:
        return int(self.block_tables.shape[1])


@dataclass
class ImageSplice:
    """Embeddings that replace the token embeddings at some rows of a batch (the image spans' part in it)."""

    rows: torch.Tensor  # [R] int64 rows of the packed batch
    values: torch.Tensor  # [R, hidden]


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    spans: list[SequenceSpan]
    cache: KVCache | KVCacheV41 | None
    image_splice: ImageSplice | None = None  # V4.1: image-span embeddings replacing the placeholder rows
    _slices: list[slice] = field(default_factory=list, repr=False)
    _device_spans: DeviceSpans | None = field(default=None, repr=False)
    # RoPE angles the layers share within one forward (dsinfer.layers.rotary.step_rope_angles); emptied per forward
    rope_angle_memo: dict = field(default_factory=dict, repr=False)
    # A fixed-width verify step (FixedWidthBatch.packed): the compressors update column by column, recorded in
    # ``column_journal``, then every row attends at once; None: a plain batch.
    fixed_width: FixedWidthBatch | None = field(default=None, repr=False)
    column_journal: PendingJournal | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        offset = 0
        for span in self.spans:
            self._slices.append(slice(offset, offset + span.length))
            offset += span.length
        if offset != self.input_ids.shape[0]:
            raise ValueError(f"spans cover {offset} tokens but the batch holds {self.input_ids.shape[0]}")

    @classmethod
    def from_sequences(cls, sequences: list[list[int]], device: torch.device | str = "cpu") -> PackedBatch:
        """Whole sequences from position 0; the model gives them a scratch cache when it runs them."""
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("every sequence in a batch needs at least one token")
        lengths = [len(s) for s in sequences]
        spans = [SequenceSpan(0, length, slot, []) for slot, length in enumerate(lengths)]
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        return cls(ids, positions, spans, None)

    def attach_scratch_cache(self, cache: KVCache | KVCacheV41) -> None:
        """Give a batch of fresh sequences a throw-away ``cache`` (the model builds it for the batch's lengths:
        ``scratch_cache``) and consecutive blocks."""
        if any(span.start for span in self.spans):
            raise ValueError("only sequences starting at position 0 can run without an engine cache")
        self.cache = cache
        next_block = 0
        for span in self.spans:
            blocks = math.ceil(span.length / self.cache.block_tokens)
            span.block_table = list(range(next_block, next_block + blocks))
            next_block += blocks

    @property
    def is_decode(self) -> bool:
        """Every sequence runs exactly one new token (a pure decode step: the batched, sync-free path)."""
        return all(span.length == 1 for span in self.spans)

    @property
    def device_spans(self) -> DeviceSpans:
        """The spans as device tensors (built on first use, once per step)."""
        if self._device_spans is None:
            device = self.input_ids.device
            trash = self.cache.trash_block
            width = max(1, max(len(span.block_table) for span in self.spans))
            tables = np.full((len(self.spans), width), trash, dtype=np.int64)  # row by row: no nested list
            for row, span in enumerate(self.spans):
                tables[row, : len(span.block_table)] = span.block_table
            rows = [piece.stop - 1 for piece in self._slices]
            self._device_spans = DeviceSpans(
                slots=host_to_device([span.slot for span in self.spans], torch.long, device),
                starts=host_to_device([span.start for span in self.spans], torch.long, device),
                window_from=host_to_device([span.window_from for span in self.spans], torch.long, device),
                block_tables=host_to_device(tables, torch.long, device),
                token_rows=host_to_device(rows, torch.long, device),
            )
        return self._device_spans

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> list[int]:
        return [span.length for span in self.spans]

    def sequence_slices(self) -> list[slice]:
        """Token ranges of each sequence inside the packed tensors."""
        return self._slices

    def last_token_indices(self) -> torch.Tensor:
        return host_to_device([s.stop - 1 for s in self._slices], torch.long, self.input_ids.device)
