"""Engram hashing: token ids in, table row ids out (DeepSeek-V4.1, layers 1 and 14).

For every position t an Engram layer reads ``(max_ngram_size - 1) * n_heads`` rows of its
own table (24 for the release: n-grams of size 2, 3, 4, times 8 heads).  This module
computes which rows; the tables themselves live elsewhere (``dsinfer.engram.store``).

The hash, checked against Hugging Face ``modeling_deepseek_v41.py``
(``EngramLayout``, ``compute_hash_multipliers``, ``DeepseekV41NgramHashState``):

* ``g_k`` (k = 0 .. max_ngram_size - 1) is the compressed id of the token at t - k
  (:mod:`dsinfer.engram.vocabulary`).  Look-back is *blocked* at the sequence start and
  at image tokens (``image_token_id``; every position of an image span carries it): once
  the look-back reaches a blocked slot, that slot and every older one read the pad id
  (the compressed id of ``engram_pad_id``).  An image token itself hashes as all pad.
* Each layer has ``max_ngram_size`` odd multipliers ``m_k``: numpy
  ``default_rng(10007 * layer_id).integers(0, (2**63 - 1) // V // 2, max_ngram_size)``
  times 2 plus 1, with V = ``engram_compressed_vocab_size``.  The bound keeps ``g * m``
  below 2**63, so the int64 products never wrap.
* The n-gram hash is the rolling XOR ``h_n = (g_0 m_0) ^ (g_1 m_1) ^ ... ^ (g_{n-1} m_{n-1})``.
* Every (layer, n, head) owns a prime: the primes from ``engram_vocab_size`` upward,
  taken in order (layer, then n, then head) and never reused across layers.
* Row ``h_n mod p + offset`` where the offsets are the running sum of *that layer's*
  primes in (n, head) order: each layer addresses its own table from row 0, and the
  table has exactly the sum of its primes as rows (:meth:`EngramHasher.table_sizes`).

A packed batch (several sequences' new tokens laid end to end) is hashed in one
vectorised call.  A sequence that continues (a later prefill chunk, a decode step)
brings its :class:`EngramContext`: the compressed ids of its last
``max_ngram_size - 1`` tokens, which is all the state the engine keeps for Engram.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dsinfer.config import engram_primes, is_prime
from dsinfer.engram.vocabulary import build_compressed_vocabulary
from dsinfer.ops.engram_rows import ENGRAM_DEAD, EngramRowHashing, rolling_hash

__all__ = [
    "ENGRAM_DEAD",
    "EngramContext",
    "EngramHasher",
    "engram_primes",
    "hash_multipliers",
    "is_prime",
]


def hash_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> list[int]:
    """The layer's odd multipliers m_0 .. m_{max_ngram_size - 1} (numpy PCG64, as in training)."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
    return [int(x) * 2 + 1 for x in draws]


@dataclass(frozen=True)
class EngramContext:
    """The Engram state of one sequence between forward calls.

    ``history`` holds the compressed ids of the sequence's last ``max_ngram_size - 1``
    tokens, oldest first, with :data:`ENGRAM_DEAD` where an n-gram must not reach (slots
    before the sequence start, image tokens).  A new sequence starts from
    :meth:`empty`; :meth:`EngramHasher.advance` (one sequence) or
    :meth:`EngramHasher.next_contexts` (a packed batch) moves it past new tokens.
    Immutable, so a speculative step can keep the old one to roll back to.
    """

    history: tuple[int, ...]

    @classmethod
    def empty(cls, max_ngram_size: int = 4) -> EngramContext:
        """The context of a sequence with no tokens yet."""
        return cls((ENGRAM_DEAD,) * (max_ngram_size - 1))

    @staticmethod
    def stack(contexts: Sequence[EngramContext], device: torch.device | str | None = None) -> torch.Tensor:
        """``[len(contexts), max_ngram_size - 1]`` int64, the form the hasher's batch calls take."""
        return torch.tensor([c.history for c in contexts], dtype=torch.int64, device=device)


class EngramHasher:
    """Row ids of the Engram tables for packed batches of token ids.

    Construct from the V4.1 config values and the compressed vocabulary
    (:func:`~dsinfer.engram.vocabulary.build_compressed_vocabulary`), or with
    :meth:`from_tokenizer`.  ``image_token_id=None`` turns image handling off.
    All token-sized work is vectorised torch on the device of :meth:`to`.
    """

    def __init__(
        self,
        compressed_vocabulary: torch.Tensor,
        *,
        engram_layer_ids: Sequence[int],
        engram_vocab_size: int,
        engram_max_ngram_size: int,
        engram_n_heads: int,
        engram_pad_id: int,
        engram_compressed_vocab_size: int,
        image_token_id: int | None,
    ) -> None:
        layer_ids = tuple(int(i) for i in engram_layer_ids)
        if not layer_ids or len(set(layer_ids)) != len(layer_ids) or min(layer_ids) < 0:
            raise ValueError(f"engram_layer_ids must be distinct non-negative layer ids, got {list(layer_ids)}")
        if engram_max_ngram_size < 2:
            raise ValueError(f"engram_max_ngram_size must be at least 2, got {engram_max_ngram_size}")
        if engram_n_heads < 1:
            raise ValueError(f"engram_n_heads must be at least 1, got {engram_n_heads}")
        if engram_vocab_size < 2:
            raise ValueError(f"engram_vocab_size must be at least 2, got {engram_vocab_size}")
        table = torch.as_tensor(compressed_vocabulary).to(torch.int64).flatten().cpu()
        if table.numel() == 0 or int(table.min()) < 0:
            raise ValueError("the compressed vocabulary must be a non-empty table of non-negative ids")
        if int(table.max()) + 1 != engram_compressed_vocab_size:
            raise ValueError(
                f"the compressed vocabulary has {int(table.max()) + 1} ids but engram_compressed_vocab_size "
                f"is {engram_compressed_vocab_size}"
            )
        if not 0 <= engram_pad_id < table.numel():
            raise ValueError(f"engram_pad_id {engram_pad_id} is outside the vocabulary of {table.numel()} tokens")

        self.layer_ids = layer_ids
        self.max_ngram_size = engram_max_ngram_size
        self.n_heads = engram_n_heads
        self.n_columns = (engram_max_ngram_size - 1) * engram_n_heads
        self.image_token_id = image_token_id
        self.compressed_vocab_size = engram_compressed_vocab_size
        self.pad_compressed_id = int(table[engram_pad_id])
        self.compressed_vocabulary = table

        primes = engram_primes(len(layer_ids), engram_vocab_size, engram_max_ngram_size, engram_n_heads)
        self._primes = torch.tensor(primes, dtype=torch.int64)  # [L, N - 1, H]
        flat = self._primes.flatten(1)  # [L, n_columns], (n, head) order
        self._offsets = flat.cumsum(1) - flat  # running sum of the layer's own primes, from 0
        self._table_sizes = {layer: int(size) for layer, size in zip(layer_ids, flat.sum(1).tolist(), strict=True)}
        self._multipliers = torch.tensor(
            [hash_multipliers(layer, engram_max_ngram_size, engram_compressed_vocab_size) for layer in layer_ids],
            dtype=torch.int64,
        )  # [L, N]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, **config: Any) -> EngramHasher:
        """Build the compressed vocabulary from ``tokenizer`` (size-checked), then the hasher."""
        table = build_compressed_vocabulary(tokenizer, expected_size=config["engram_compressed_vocab_size"])
        return cls(table, **config)

    def to(self, device: torch.device | str) -> EngramHasher:
        """Move the lookup tables to ``device`` (in place); returns ``self``."""
        self.compressed_vocabulary = self.compressed_vocabulary.to(device)
        self._primes = self._primes.to(device)
        self._offsets = self._offsets.to(device)
        self._multipliers = self._multipliers.to(device)
        return self

    # ------------------------------------------------------------------ layout
    def table_sizes(self) -> dict[int, int]:
        """Rows of each layer's table, ``{layer_id: rows}`` (the sum of that layer's primes)."""
        return dict(self._table_sizes)

    def primes(self, layer_id: int) -> torch.Tensor:
        """``[max_ngram_size - 1, n_heads]`` bucket primes of ``layer_id`` (row n - 2 for n-grams of size n)."""
        return self._primes[self._layer_index(layer_id)]

    def offsets(self, layer_id: int) -> torch.Tensor:
        """``[n_columns]`` first row of each (n, head) bucket inside the layer's table."""
        return self._offsets[self._layer_index(layer_id)]

    def multipliers(self, layer_id: int) -> torch.Tensor:
        """``[max_ngram_size]`` odd hash multipliers of ``layer_id``."""
        return self._multipliers[self._layer_index(layer_id)]

    def _layer_index(self, layer_id: int) -> int:
        if layer_id not in self.layer_ids:
            raise ValueError(f"layer {layer_id} has no Engram table (engram_layer_ids = {list(self.layer_ids)})")
        return self.layer_ids.index(layer_id)

    # ------------------------------------------------------------------ tokens
    def gate_mask(self, token_ids: torch.Tensor) -> torch.Tensor:
        """False at image tokens: the Engram layer shuts its gate there (their rows are all-pad hashes)."""
        if self.image_token_id is None:
            return torch.ones_like(token_ids, dtype=torch.bool)
        return token_ids != self.image_token_id

    @property
    def vocab_size(self) -> int:
        """How many token ids the compressed vocabulary maps (ids in ``[0, vocab_size)``)."""
        return self.compressed_vocabulary.numel()

    def compress(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Compressed ids of ``token_ids``, :data:`ENGRAM_DEAD` at image tokens."""
        return self._compress(self._check_token_ids(token_ids))

    def _compress(self, token_ids: torch.Tensor) -> torch.Tensor:
        """:meth:`compress` without the range check: the forward's ids were checked where they entered (the
        engine's prompt check), and checking a device tensor here would read it on the host."""
        compressed = self.compressed_vocabulary[token_ids]
        return compressed.masked_fill(~self.gate_mask(token_ids), ENGRAM_DEAD)

    def lookback_ids(
        self,
        token_ids: torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor | None = None,
        contexts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[T, max_ngram_size]`` the g_k that get hashed: column k is the compressed id at t - k,
        the pad id where the look-back is blocked."""
        compressed = self.compress(token_ids)
        lengths = self._lengths(seq_lens, compressed.numel())
        buffer, token_slots, _ = self._history_buffer(compressed, lengths, self._checked_contexts(contexts, lengths))
        return self._lookback(buffer, token_slots)

    def _lookback(self, buffer: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
        looked = torch.stack([buffer[token_slots - k] for k in range(self.max_ngram_size)], dim=1)
        blocked = (looked == ENGRAM_DEAD).cumsum(dim=1) > 0
        return looked.masked_fill(blocked, self.pad_compressed_id)

    # ------------------------------------------------------------------ hashes
    def row_ids(
        self,
        token_ids: torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor | None,
        layer_id: int,
        contexts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[T, n_columns]`` rows of ``layer_id``'s table for a packed batch.

        ``token_ids`` [T] holds the new tokens of ``len(seq_lens)`` sequences end to end
        (``seq_lens=None``: one sequence).  ``contexts`` [S, max_ngram_size - 1] (see
        :meth:`EngramContext.stack`) gives each sequence's look-back before its first new
        token; ``None`` means every sequence starts here.  Columns are in (n, head) order:
        column ``(n - 2) * n_heads + j`` is head j of the n-gram of size n.
        """
        index = self._layer_index(layer_id)
        tokens = self.lookback_ids(token_ids, seq_lens, contexts)
        return self._hash(tokens, self._multipliers[index], self._primes[index], self._offsets[index])

    def all_row_ids(
        self,
        token_ids: torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor | None = None,
        contexts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[T, num_engram_layers, n_columns]``: :meth:`row_ids` of every Engram layer in one pass."""
        tokens = self.lookback_ids(token_ids, seq_lens, contexts).unsqueeze(1)  # [T, 1, N]
        return self._hash(tokens, self._multipliers, self._primes, self._offsets)

    def next_contexts(
        self,
        token_ids: torch.Tensor,
        seq_lens: Sequence[int] | torch.Tensor | None = None,
        contexts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[S, max_ngram_size - 1]`` each sequence's context after its new tokens."""
        compressed = self.compress(token_ids)
        lengths = self._lengths(seq_lens, compressed.numel())
        _, _, after = self._history_buffer(compressed, lengths, self._checked_contexts(contexts, lengths))
        return after

    def prefill_step(
        self,
        token_ids: torch.Tensor,
        seq_lens: Sequence[int],
        contexts: torch.Tensor,
        sequence_ends: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed batch's rows ``[T, num_engram_layers, n_columns]`` and next contexts ``[S, w]``, no host read.

        The forward's form of :meth:`all_row_ids` and :meth:`next_contexts` (the same integers, one pass):
        ``seq_lens`` are the host's lengths, ``contexts`` [S, w] each sequence's look-back (from the cache),
        ``sequence_ends`` [S] on the device the running sum of ``seq_lens`` (the step's metadata; None: copied
        from the host). Neither the ids nor the contexts are range-checked here: they were where they entered.
        """
        lengths = [int(n) for n in seq_lens]
        buffer, token_slots, after = self._history_buffer(self._compress(token_ids), lengths, contexts, sequence_ends)
        looked = self._lookback(buffer, token_slots).unsqueeze(1)  # [T, 1, N]
        return self._hash(looked, self._multipliers, self._primes, self._offsets), after

    def decode_step(self, token_ids: torch.Tensor, contexts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token per sequence: rows ``[B, num_engram_layers, n_columns]`` and the next contexts ``[B, w]``.

        The decode step's form of :meth:`all_row_ids` and :meth:`next_contexts` (the same integers), with no
        host read: the ids are the sampler's (not range-checked here) and each sequence has exactly one token.
        """
        compressed = self.compressed_vocabulary[token_ids].masked_fill(~self.gate_mask(token_ids), ENGRAM_DEAD)
        history = torch.cat([contexts, compressed[:, None]], dim=1)  # oldest first; the token last
        looked = history.flip(1)  # column k: the id at t - k
        looked = looked.masked_fill((looked == ENGRAM_DEAD).cumsum(dim=1) > 0, self.pad_compressed_id)
        rows = self._hash(looked.unsqueeze(1), self._multipliers, self._primes, self._offsets)
        return rows, history[:, 1:]

    def decode_rows(
        self, token_ids: torch.Tensor, history: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, ops
    ) -> torch.Tensor:
        """:meth:`decode_step` for the cache's histories [slots, w], as one op (``engram_decode_rows`` of ``ops``):
        rows ``[B, num_engram_layers, n_columns]`` of the tokens at ``starts`` of the sequences in ``slots``, each
        history advanced in place (a sequence at position 0 starts from none)."""
        hashing = EngramRowHashing(self.compressed_vocabulary, self.image_token_id, self.pad_compressed_id,
                                   self._multipliers, self._primes, self._offsets)  # fmt: skip
        return ops.engram_decode_rows(token_ids, history, slots, starts, hashing)

    def advance(self, context: EngramContext, token_ids: Sequence[int] | torch.Tensor) -> EngramContext:
        """One sequence's context moved past ``token_ids``."""
        tokens = torch.as_tensor(token_ids, dtype=torch.int64, device=self.compressed_vocabulary.device).flatten()
        stacked = EngramContext.stack([context], device=tokens.device)
        return EngramContext(tuple(self.next_contexts(tokens, [tokens.numel()], stacked)[0].tolist()))

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _hash(
        tokens: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Rolling XOR of g_k * m_k (:func:`~dsinfer.ops.engram_rows.rolling_hash`, shared with the decode op)."""
        return rolling_hash(tokens, multipliers, primes, offsets)

    def _check_token_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1:
            raise ValueError("token_ids must be a 1-D tensor of token ids")
        if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
            raise ValueError(f"token_ids must hold integers, got {token_ids.dtype}")
        token_ids = token_ids.to(torch.int64)
        vocab_size = self.compressed_vocabulary.numel()
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
            raise ValueError(f"token ids must lie in [0, {vocab_size})")
        return token_ids

    @staticmethod
    def _lengths(seq_lens: Sequence[int] | torch.Tensor | None, total: int) -> list[int]:
        """The sequences' lengths as host ints (a tensor of lengths is read on the host), checked."""
        if seq_lens is None:
            return [total]
        if isinstance(seq_lens, torch.Tensor):
            seq_lens = seq_lens.flatten().tolist()
        lengths = [int(n) for n in seq_lens]
        if not lengths or min(lengths) < 0 or sum(lengths) != total:
            raise ValueError(f"seq_lens must be non-negative and add up to the {total} tokens of the batch")
        return lengths

    def _checked_contexts(self, contexts: torch.Tensor | None, lengths: list[int]) -> torch.Tensor:
        """Caller-given contexts (``None``: every sequence starts here) as int64, shape- and range-checked."""
        width, device = self.max_ngram_size - 1, self.compressed_vocabulary.device
        if contexts is None:
            return torch.full((len(lengths), width), ENGRAM_DEAD, dtype=torch.int64, device=device)
        contexts = torch.as_tensor(contexts, dtype=torch.int64).to(device)
        if contexts.shape != (len(lengths), width):
            raise ValueError(
                f"contexts must have shape ({len(lengths)}, {width}), one row per sequence, got {tuple(contexts.shape)}"
            )
        limit = self.compressed_vocab_size
        if contexts.numel() and (int(contexts.min()) < ENGRAM_DEAD or int(contexts.max()) >= limit):
            raise ValueError(f"context entries must be compressed ids in [0, {limit}) or ENGRAM_DEAD")
        return contexts

    def _history_buffer(
        self,
        compressed: torch.Tensor,
        lengths: list[int],
        contexts: torch.Tensor,
        sequence_ends: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Lay every sequence out as ``[context | compressed tokens]`` in one flat buffer.

        Returns the buffer, the slot of each token in it (the look-back of slot s is s - 1, s - 2, ... and never
        leaves the token's own sequence) and each sequence's context after its tokens [S, w]. Every shape comes
        from the host's ``lengths``; ``sequence_ends`` [S] (their running sum on the device) places the tokens.
        """
        device = compressed.device
        width, total, num_sequences = self.max_ngram_size - 1, compressed.numel(), len(lengths)
        if sequence_ends is None:
            sequence_ends = torch.tensor(np.cumsum(lengths, dtype=np.int64).tolist(), device=device)
        tokens = torch.arange(total, device=device)
        sequence_of_token = torch.searchsorted(sequence_ends, tokens, right=True)
        token_slots = tokens + width * (sequence_of_token + 1)
        buffer = torch.full((total + width * num_sequences,), ENGRAM_DEAD, dtype=torch.int64, device=device)
        buffer[token_slots] = compressed
        # Sequence j's context starts after the earlier sequences' tokens and contexts; its new context is the
        # last `width` slots of its part of the buffer.
        sequence_index = torch.arange(num_sequences, device=device)
        starts = torch.cat([sequence_ends.new_zeros(1), sequence_ends[:-1]]) + width * sequence_index
        columns = torch.arange(width, device=device)
        buffer[starts.unsqueeze(1) + columns] = contexts.to(torch.int64)
        after = buffer[(sequence_ends + width * sequence_index).unsqueeze(1) + columns]
        return buffer, token_slots, after
