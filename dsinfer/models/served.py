"""The one contract between a model and everything that serves it: the engine, speculative decoding, the ranks and
the benchmarks ask a model only what :class:`ServedModel` declares, never which model it is.

A family (V4 in :mod:`dsinfer.models.deepseek_v4`, V4.1 in :mod:`dsinfer.models.deepseek_v41`) implements every
method in its own module; what differs between the families (the cache class and its block rule, the features
a drafter reads, the speculative methods, what keeps a step out of a CUDA graph, bounded prefill, Engram) is
answered here, so a caller never branches on the model's type.

The contract, by what a caller needs:

* **caches**: :meth:`~ServedModel.cache_block_tokens` (the block-size rule), :meth:`~ServedModel.build_cache`
  (the cache the layers read and write, sized from the engine's plan), :meth:`~ServedModel.scratch_cache`
  (a throw-away one for a forward without an engine);
* **forwards**: ``forward(batch, logits_for)`` over a :class:`~dsinfer.kv.batch.PackedBatch`;
  :meth:`~ServedModel.forward_for_drafter` (the logits and what the drafter reads of the target);
  :meth:`~ServedModel.verify_forward` (K + 1 positions of every sequence from device tensors alone, what a
  CUDA graph replays);
* **speculative decoding**: :meth:`~ServedModel.check_speculative_support` (which drafting method the checkpoint
  can run);
* **static-shape steps**: :meth:`~ServedModel.graph_capture_blocker` (why a step could not be captured, or
  None); :attr:`~ServedModel.ranks_replay_graphs` (whether expert-parallel ranks replay graphs);
* **prefill**: :meth:`~ServedModel.bounded_replay_tokens` (how much of a prompt bounded prefill replays);
* **Engram**: :attr:`~ServedModel.engram_hasher`, :meth:`~ServedModel.engram_history_width` (the look-back an
  entering sequence's slot needs rebuilt);
* **lifetime**: :meth:`~ServedModel.close` (release what the model holds outside itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from dsinfer.config import EngineConfig, ModelConfigBase, SpeculativeConfig
from dsinfer.kv.batch import PackedBatch
from dsinfer.kv.cache_v4 import KVCache
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.kv.fixed_width import FixedWidthBatch, PendingJournal

if TYPE_CHECKING:
    from dsinfer.engram.hashing import EngramHasher

EngineCache = KVCache | KVCacheV41


@dataclass(frozen=True)
class CachePlan:
    """How big a cache to build: what the engine decided from its budget (``dsinfer.engine.cache_plan``)."""

    num_slots: int  # per-sequence state slots (window rings, unfinished compressor windows)
    num_blocks: int  # blocks of compressed entries in the pool
    block_tokens: int  # positions per block (the model's rule: ``cache_block_tokens``)
    device: torch.device | str
    with_drafter: bool = False  # the drafter's state for speculative decoding too
    kv_cache_dtype: str = "auto"  # the engine's storage choice (EngineConfig.kv_cache_dtype)


class ServedModel(nn.Module):
    """What a served model answers (see the module docstring); each family implements every method."""

    config: ModelConfigBase
    # Token ids to Engram rows (V4.1 checkpoints with Engram layers, attached at load); None: no Engram.
    engram_hasher: EngramHasher | None = None
    # Expert-parallel ranks replay captured decode steps (every rank in the same order); False: they run eagerly.
    ranks_replay_graphs: bool = True

    # ---- caches ------------------------------------------------------------------------------------------
    def cache_block_tokens(self, requested: int | None) -> int:
        """Positions per cache block: ``requested`` if the model's compression ratios allow it, else the model's
        default; raises ``ValueError`` naming ``block_tokens`` when they do not."""
        raise NotImplementedError

    def build_cache(self, plan: CachePlan) -> EngineCache:
        """The cache the layers read and write through the batch metadata, as big as ``plan`` says (on the ``meta``
        device: byte accounting only), with the drafter's state where the plan asks for it."""
        raise NotImplementedError

    def scratch_cache(self, seq_lens: list[int], device: torch.device | str, with_drafter: bool) -> EngineCache:
        """A throw-away cache just big enough for whole sequences of ``seq_lens`` run from position 0 (a forward
        without an engine: the batch gets it, see ``PackedBatch.attach_scratch_cache``)."""
        raise NotImplementedError

    # ---- forwards ----------------------------------------------------------------------------------------
    def forward(self, batch: PackedBatch, logits_for: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits [T, vocab] of every token of ``batch``, or only of the token indices ``logits_for``;
        writes the batch's cache (a scratch one when it has none)."""
        raise NotImplementedError

    def forward_for_drafter(
        self, batch: PackedBatch, logits_for: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits :meth:`forward` gives and, for every token, what the family's drafter reads of the target
        [T, ...] (V4: the residual streams; V4.1: the captured mean streams of its DSpark target layers)."""
        raise NotImplementedError

    def verify_forward(self, batch: FixedWidthBatch, journal: PendingJournal) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_for_drafter` of every row [B * width, ...] of a fixed-width verify step: per-token work
        over all rows, the compressors' updates column by column (recorded in ``journal``), then every row's
        attention at once. No
        value is read on the host and no shape depends on one, so a CUDA graph can replay it."""
        return self.forward_for_drafter(batch.packed(journal), None)

    # ---- speculative decoding ----------------------------------------------------------------------------
    def check_speculative_support(self, config: SpeculativeConfig) -> None:
        """Raise :class:`~dsinfer.config.ConfigError` naming ``speculative_config``'s field when this checkpoint
        cannot draft with ``config``."""
        raise NotImplementedError

    # ---- static-shape steps ------------------------------------------------------------------------------
    def graph_capture_blocker(self, device: torch.device, step_rows: int) -> str | None:
        """Why decode steps of up to ``step_rows`` token rows on CUDA ``device`` cannot be captured in a graph
        (a backend that syncs, data read through the host), or None when they can."""
        raise NotImplementedError

    # ---- prefill -----------------------------------------------------------------------------------------
    def bounded_replay_tokens(self, engine: EngineConfig) -> int | None:
        """How many of a prompt's last tokens the decoder layers run over (bounded prefill) under ``engine``'s
        options, or None when prompts prefill exactly (every layer over every token). Raises
        :class:`~dsinfer.config.ConfigError` naming the engine option that cannot hold."""
        return None

    # ---- Engram ------------------------------------------------------------------------------------------
    def engram_history_width(self) -> int:
        """Tokens of look-back a slot's Engram history holds (0: the model keeps none), which a sequence
        entering its slot past position 0 needs rebuilt."""
        return 0

    # ---- lifetime ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release what the model holds outside itself (shared memory, fetchers). Idempotent."""
