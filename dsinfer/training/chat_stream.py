"""The training chats, encoded: an endless stream in a fixed order, rendered by worker processes, resumable.

Chunk ``i`` of the stream is the 64 chats of ``sample_stream(seed * 1_000_003 + i)`` (deterministic per index),
so a run resumed at ``position`` (chunk, offset) reads exactly the chats the uninterrupted run would have read.
"""

from __future__ import annotations

import collections
import multiprocessing
from pathlib import Path

import torch

from dsinfer.chat.format import ChatFormat
from dsinfer.tokenizer import Tokenizer
from dsinfer.training.corpus import sample_stream
from dsinfer.training.render import SampleRenderer

CHUNK_CHATS = 64

_worker_renderer: SampleRenderer | None = None


def _start_worker(tokenizer_dir: str) -> None:
    global _worker_renderer
    torch.set_num_threads(1)
    _worker_renderer = SampleRenderer(ChatFormat(Tokenizer.from_dir(tokenizer_dir), "v41", "default"))


def _encoded_chunk(job: tuple[int, int]) -> list[tuple[list[int], list[int]]]:
    """Chunk ``index`` of the sample stream of ``seed``, encoded as (prompt ids, completion ids) pairs."""
    seed, index = job
    stream = sample_stream(seed * 1_000_003 + index)
    return [_worker_renderer.encode(next(stream)) for _ in range(CHUNK_CHATS)]


class ChatStream:
    """Iterator of (prompt ids, completion ids); ``position`` is where the next chat comes from."""

    def __init__(self, tokenizer_dir: Path, seed: int, workers: int, position: tuple[int, int] = (0, 0)) -> None:
        self.seed = seed
        self.chunk, self.offset = position
        self._current: list | None = None
        self._pool = None
        if workers == 0:
            _start_worker(str(tokenizer_dir))
            return
        self._pool = multiprocessing.get_context("spawn").Pool(workers, _start_worker, (str(tokenizer_dir),))
        # A bounded window of chunks in flight (an ``imap`` over the endless job stream would drain it at once:
        # the workers would render without end and this process would unpickle and hold every chunk).
        self._next_job = self.chunk
        self._pending = collections.deque(self._submit() for _ in range(2 * workers))

    @property
    def position(self) -> tuple[int, int]:
        return self.chunk, self.offset

    def _submit(self):
        job = (self.seed, self._next_job)
        self._next_job += 1
        return self._pool.apply_async(_encoded_chunk, (job,))

    def _fetch(self) -> list:
        if self._pool is None:
            return _encoded_chunk((self.seed, self.chunk))
        chunk = self._pending.popleft().get()
        self._pending.append(self._submit())
        return chunk

    def __iter__(self) -> ChatStream:
        return self

    def __next__(self) -> tuple[list[int], list[int]]:
        if self._current is None:
            self._current = self._fetch()
        if self.offset == len(self._current):
            self.chunk, self.offset = self.chunk + 1, 0
            self._current = self._fetch()
        self.offset += 1
        return self._current[self.offset - 1]

    def close(self) -> None:
        """Stop the rendering workers."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None
