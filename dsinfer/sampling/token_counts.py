"""Device tensors of how often each request has generated each token, and which tokens its prompt holds.

The penalties need, per request, a ``[V]`` count of its output tokens (presence and frequency) and a ``[V]``
mask of every token seen in prompt or output (repetition). Building them from the token lists each step costs
host time in the prompt's length; :class:`TokenCounts` keeps them on the device instead, one row of a pool per
request, and each step only scatters the tokens appended since the last one (usually one per request), for
the whole batch in one ``index_put_``. :func:`count_tokens` builds the same tensors from scratch, for callers
that penalise hypothetical outputs (speculative drafts) and must not touch the cache.

A row belongs to a request object for as long as that object lives: the pool keeps a weak reference and
takes the row back once the request is gone. A request whose output list got shorter than what was counted
(it was rebuilt) is counted again from scratch. Not thread-safe: the sampler's one thread calls it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dsinfer.sampling.host_copies import device_index


class _HasTokens(Protocol):
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class _Row:
    owner: weakref.ref
    slot: int
    counted: int  # output tokens already scattered into the pool


def count_tokens(
    states: Sequence[_HasTokens], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output token counts (int32 ``[n, V]``) and prompt token mask (bool ``[n, V]``), built from the lists."""
    counts = torch.zeros(len(states), vocab_size, dtype=torch.int32, device=device)
    prompt_seen = torch.zeros(len(states), vocab_size, dtype=torch.bool, device=device)
    _scatter(counts, prompt_seen, states, range(len(states)), [0] * len(states), fresh=[True] * len(states))
    return counts, prompt_seen


def _scatter(counts, prompt_seen, states, slots, counted, fresh) -> None:
    """Add each state's output tokens from ``counted`` on to its ``slot`` row; mark prompts of ``fresh`` rows."""
    device = counts.device
    count_rows: list[int] = []
    count_ids: list[int] = []
    prompt_rows: list[int] = []
    prompt_ids: list[int] = []
    for state, slot, start, is_fresh in zip(states, slots, counted, fresh, strict=True):
        new = state.output_token_ids[start:]
        count_rows += [slot] * len(new)
        count_ids += new
        if is_fresh:
            prompt_rows += [slot] * len(state.prompt_token_ids)
            prompt_ids += state.prompt_token_ids
    if prompt_ids:
        where = (device_index(prompt_rows, device), device_index(prompt_ids, device))
        prompt_seen.index_put_(where, torch.ones((), dtype=torch.bool, device=device))
    if count_ids:
        where = (device_index(count_rows, device), device_index(count_ids, device))
        counts.index_put_(where, torch.ones((), dtype=torch.int32, device=device), accumulate=True)


class TokenCounts:
    """The pool of per-request rows (see the module docstring)."""

    def __init__(self) -> None:
        self._rows: dict[int, _Row] = {}  # id(state) -> its row; the weak reference tells a reused id apart
        self._free: list[int] = []
        self._counts: torch.Tensor | None = None  # int32 [capacity, V]
        self._prompt_seen: torch.Tensor | None = None  # bool [capacity, V]

    def gather(
        self, states: Sequence[_HasTokens], vocab_size: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring every state's row up to date and return copies for the batch: counts and prompt mask."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # what a tensor's .device reports
        if self._counts is None or self._counts.device != device or self._counts.shape[1] != vocab_size:
            self._reset(vocab_size, device)
        rows, fresh = [], []
        for state in states:
            row = self._rows.get(id(state))
            stale = row is None or row.owner() is not state or len(state.output_token_ids) < row.counted
            if stale:
                row = self._claim(state)
            rows.append(row)
            fresh.append(stale)
        slots = [row.slot for row in rows]
        fresh_slots = [slot for slot, is_fresh in zip(slots, fresh, strict=True) if is_fresh]
        if fresh_slots:
            index = device_index(fresh_slots, device)
            self._counts.index_fill_(0, index, 0)
            self._prompt_seen.index_fill_(0, index, False)
        _scatter(self._counts, self._prompt_seen, states, slots, [row.counted for row in rows], fresh)
        for row, state in zip(rows, states, strict=True):
            row.counted = len(state.output_token_ids)
        index = device_index(slots, device)
        return self._counts[index], self._prompt_seen[index]  # row gathers (index_select is slower on CPU)

    @property
    def rows_in_use(self) -> int:
        """Rows held by live requests (rows of dead ones are otherwise taken back only when the pool is full)."""
        self._release_dead()
        return len(self._rows)

    def _reset(self, vocab_size: int, device: torch.device) -> None:
        self._rows.clear()
        self._free.clear()
        self._counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self._prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    def _claim(self, state: _HasTokens) -> _Row:
        """A row for ``state`` (an older row under the same id is given back first)."""
        old = self._rows.pop(id(state), None)
        if old is not None:
            self._free.append(old.slot)
        if not self._free:
            self._release_dead()
        if not self._free:
            self._grow()
        row = _Row(weakref.ref(state), self._free.pop(), 0)
        self._rows[id(state)] = row
        return row

    def _release_dead(self) -> None:
        for key, row in list(self._rows.items()):
            if row.owner() is None:
                del self._rows[key]
                self._free.append(row.slot)

    def _grow(self) -> None:
        capacity = self._counts.shape[0]
        extra = max(8, capacity)
        self._counts = torch.cat([self._counts, self._counts.new_zeros(extra, self._counts.shape[1])])
        self._prompt_seen = torch.cat([self._prompt_seen, self._prompt_seen.new_zeros(extra, self._counts.shape[1])])
        self._free.extend(range(capacity + extra - 1, capacity - 1, -1))  # lowest slot popped first
