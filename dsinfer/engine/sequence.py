"""A sequence: one completion of one request, moving through waiting -> running -> finished."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dsinfer.sampling.sampler import SamplingState

if TYPE_CHECKING:
    from dsinfer.engine.output_processor import CompletionText
    from dsinfer.images.inputs import ImageInput


_TABLE_TOKENS = itertools.count(1)


def new_table_token() -> int:
    """A number never handed out before: names one block table for as long as it only grows."""
    return next(_TABLE_TOKENS)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    index: int  # which of the request's n completions
    prompt_token_ids: list[int]
    sampling: SamplingState
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    images: tuple[ImageInput, ...] = ()  # V4.1: image spans of the prompt, in order (each knows its offset)
    # Cache bookkeeping, owned by the scheduler and block manager.
    num_computed: int = 0  # positions whose KV is in the cache (the model has run them)
    slot: int | None = None
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # content hashes of the leading computed blocks
    # Names the block table while it only grows (a new token when it is rebuilt or shrinks): decode graphs
    # rewrite a staged table row only when its token changes (dsinfer.engine.graph_inputs).
    table_token: int = field(default_factory=new_table_token)
    # The block table as of the last step that read it (immutable; rebuilt when the token or the length changed).
    table_snapshot: tuple[int, ...] = field(default=(), repr=False, compare=False)
    snapshot_key: tuple[int, int] | None = field(default=None, repr=False, compare=False)
    reuse_below: int = 0  # prefix-cache hit: entries for windows ending at or before this position are shared
    window_from: int = 0  # oldest position whose window KV the ring holds
    num_preemptions: int = 0
    # A token being sampled by a step still on the device (overlap scheduling plans the next step around it).
    num_pending_tokens: int = 0
    # Speculative decoding: tokens the drafter proposes after the last one, verified in the next step.
    draft_token_ids: list[int] = field(default_factory=list)
    # Results.
    output_text: CompletionText | None = None  # the text so far and the stop strings (set by the engine)
    hide_last_token: bool = False  # the last token is a stop token: not part of the text
    finish_reason: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.sampling.output_token_ids = self.output_token_ids  # one list, shared with the sampler's view

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, counting one still being sampled."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_between(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without joining the whole prompt and output first (a decode step reads one
        token of a sequence whose prompt may be thousands long)."""
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt) : end - len(prompt)]
        return prompt[start:] + self.output_token_ids[: end - len(prompt)]

    def block_table_now(self) -> tuple[int, ...]:
        """The block table as it is now, as a tuple a step in flight keeps while the scheduler grows or drops the
        live list. The table only grows under one ``table_token`` (any other change takes a new token), so the
        tuple is built again only when the token or the length changed: a decode step at 131,072 tokens reads
        1,025 entries a sequence, and copying them every step, with the collector walking each copy, cost about
        3.7 ms of host time a step at 256 sequences (``benchmarks/step_prepare_host.py``, on a CPU)."""
        key = (self.table_token, len(self.block_table))
        if key != self.snapshot_key:
            self.table_snapshot, self.snapshot_key = tuple(self.block_table), key
        return self.table_snapshot

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def reset_cache_state(self) -> None:
        """Forget everything cached (preemption by recompute): the tokens stay, their KV is rebuilt later."""
        self.num_computed = 0
        self.slot = None
        self.block_table = []
        self.table_token = new_table_token()
        self.block_hashes = []
        self.reuse_below = 0
        self.window_from = 0
        self.draft_token_ids = []
