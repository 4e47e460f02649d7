"""What V4.1's source layers publish, within one forward, to the layers after them.

A KV source compresses and caches entries and index keys that the compressed layers after it read; an index
source chooses which entries its queries (and those of the layers after it) attend to; the candidate source
limits where later index sources may choose. A later source *replaces* what an earlier one published. What
outlives the forward (windows, entries, keys) lives in the cache; these objects hold only the forward's view,
in the form each kind of forward reads it:

* a prefill forward publishes per sequence (:class:`SequenceState`) plus the batch's op-layout views
  (:class:`PrefillViews`);
* a decode step publishes once for the whole batch (:class:`DecodeState`: every tensor one row per sequence);
* a fixed-width (verify) forward runs every row as a decode step of its position, all rows at once: one
  :class:`DecodeState` with a row per position, in the packed order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsinfer.kv.batch import PackedBatch


@dataclass
class SourceEntries:
    """A KV source's compressed entries and index keys, as the layers after it read them.

    Prefill: one sequence's entries [W, D] and keys [W, d] (every entry finished so far)."""

    entries: torch.Tensor
    index_keys: torch.Tensor


@dataclass
class SequenceState:
    """What the sources published for one sequence of a prefill."""

    source: SourceEntries | None = None  # the latest KV source's entries and keys
    candidate_blocks: torch.Tensor | None = None  # bool [n, ceil(W / block)], the candidate source's blocks


@dataclass
class PrefillViews:
    """The batch's inputs to ``sparse_attention_prefill`` that the sources publish (op layout, every sequence)."""

    entries: torch.Tensor | None = None  # the latest KV source's entries, paged [blocks, per_block, D]
    entry_tables: torch.Tensor | None = None  # [B, max_blocks]: where each sequence's entries are in ``entries``
    ratio: int = 0  # that source's compress ratio
    indices: torch.Tensor | None = None  # [T, K] the latest index source's choice per token, -1 padding


@dataclass
class DecodeState:
    """What the sources published in one decode step, for every sequence at once (no host reads)."""

    entries_layer: int | None = None  # the layer whose cached entries and index keys the later layers read
    indices: torch.Tensor | None = None  # [B, k] the latest index source's choice (ascending), -1 after it
    candidates: torch.Tensor | None = None  # the candidate source's mask over the entries it scored
    visible: dict[int, torch.Tensor] = field(default_factory=dict)  # ratio -> entries each query sees [B]


@dataclass
class PublishedState:
    """Everything V4.1's sources publish during one forward; made fresh for every forward (and sub-batch)."""

    sequences: list[SequenceState]  # prefill: one per sequence; decode and verify: none
    prefill: PrefillViews = field(default_factory=PrefillViews)
    decode: DecodeState = field(default_factory=DecodeState)  # decode and verify steps

    @classmethod
    def for_batch(cls, batch: PackedBatch) -> PublishedState:
        """Empty state shaped for ``batch``: a decode or fixed-width (verify) step publishes once for all its
        rows, a prefill per sequence."""
        return cls([]) if batch.is_decode or batch.fixed_width is not None else cls.per_sequence(batch)

    @classmethod
    def per_sequence(cls, batch: PackedBatch) -> PublishedState:
        """Empty state with one :class:`SequenceState` per sequence of ``batch`` (a CED sub-batch's compressor
        pass publishes per sequence whatever its lengths)."""
        return cls([SequenceState() for _ in batch.spans])
