"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Each step has a token budget (``max_num_batched_tokens``). Running sequences go first, decodes before
prefill chunks (a decoding sequence's speculative drafts run behind its last token, budget allowing); then
waiting sequences are admitted while state slots, budget and cache blocks allow. A long
prompt is split across steps (chunked prefill). When blocks run out, the most recently admitted running
sequence is preempted: its cache is dropped and it waits to be recomputed later (nothing is lost, the tokens
it produced stay). A step may give a sequence several new tokens, which is what verifying speculative drafts
will need.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from dsinfer.engine.block_manager import BlockManager
from dsinfer.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # positions this step runs, drafts included
    num_draft_tokens: int = 0  # speculative drafts run behind the sequence's last token (the last positions)

    @property
    def completes_sequence(self) -> bool:
        """True when this step reaches the sequence's last token, so its logits are sampled."""
        return self.seq.num_computed + self.num_new_tokens - self.num_draft_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        num_slots: int,
        max_num_batched_tokens: int,
        chunked_prefill: bool,
        replay_tokens: int,
    ) -> None:
        self.blocks = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.replay_tokens = replay_tokens
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Decodes (one token left) before prefill chunks; each group keeps its admission order.
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed > 1):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            count = self._chunk(seq, budget)
            if count == 0:
                continue
            drafts = min(len(seq.draft_token_ids), budget - count) if count == seq.num_uncomputed == 1 else 0
            if not self._make_room(seq, count + drafts, out):
                continue
            self.blocks.allocate(seq, seq.num_computed + count + drafts)
            out.scheduled.append(ScheduledSequence(seq, count + drafts, drafts))
            budget -= count + drafts
        while self.waiting and budget > 0 and self.free_slots:
            seq = self.waiting[0]
            if seq.num_pending_tokens:
                break  # preempted while its last token is still being sampled: admit it next step
            self._attach_cached_prefix(seq)
            count = self._chunk(seq, budget)
            if count == 0 or self.blocks.blocks_needed(seq, seq.num_computed + count) > self.blocks.num_free:
                self._release(seq)
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, seq.num_computed + count)
            seq.slot = self.free_slots.pop()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, count))
            budget -= count
        return out

    def fork(self, source: Sequence, clone: Sequence) -> None:
        """Run ``clone`` from where ``source`` is: a state slot and blocks of its own for every computed position
        (the caller copies the cache into them). Raises ``ValueError`` when no slot or too few blocks are free."""
        needed = self.blocks.blocks_needed(clone, source.num_computed)
        if not self.free_slots or needed > self.blocks.num_free:
            raise ValueError(
                f"fork: needs a free state slot and {needed} free blocks; {len(self.free_slots)} slots and "
                f"{self.blocks.num_free} blocks are free"
            )
        self.blocks.allocate(clone, source.num_computed)
        clone.slot = self.free_slots.pop()
        clone.num_computed, clone.window_from = source.num_computed, source.window_from
        clone.status = SequenceStatus.RUNNING
        clone.first_scheduled_time = time.monotonic()
        self.running.append(clone)

    def finish(self, seq: Sequence) -> None:
        """Return a finished (or aborted) sequence's slot and blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def retire(self, seq: Sequence) -> None:
        """Free a running sequence's slot and blocks before it finishes: its last token is being sampled.

        Overlap scheduling calls this for a sequence whose in-flight step produces its last token by length,
        so the next step can use what it held. The device runs steps in order, so the in-flight step's
        writes land before any later owner's; :meth:`finish` then only marks it finished.
        """
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        remaining = seq.num_uncomputed
        if remaining <= budget:
            return remaining
        return budget if self.chunked_prefill else 0

    def _make_room(self, seq: Sequence, count: int, out: SchedulerOutput) -> bool:
        """Preempt the newest unscheduled running sequences until ``seq`` fits; False if ``seq`` itself went.

        The set of scheduled sequences is built only when a preemption is needed: building it for every sequence
        made a step's scheduling quadratic in the running sequences (256 x 256 a step at 256 requests)."""
        if self.blocks.blocks_needed(seq, seq.num_computed + count) <= self.blocks.num_free:
            return True
        scheduled = {id(s.seq) for s in out.scheduled}
        while self.blocks.blocks_needed(seq, seq.num_computed + count) > self.blocks.num_free:
            victims = [s for s in self.running if s is not seq and id(s) not in scheduled]
            victim = victims[-1] if victims else seq
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
        seq.reset_cache_state()

    def _attach_cached_prefix(self, seq: Sequence) -> None:
        """On a prefix-cache hit, start recomputing ``replay_tokens`` before the shared blocks end.

        Window KV is not cached, and it depends on earlier tokens through every layer, so the last
        ``replay_tokens`` positions of the hit are run again (writing only their windows and unfinished
        compressor state; the shared entries are not rewritten).
        """
        if seq.block_table:
            return
        cached = self.blocks.take_cached_prefix(seq)
        if cached == 0:
            return
        block = self.blocks.block_tokens
        replay_start = max(0, cached - self.replay_tokens) // block * block
        seq.num_computed = replay_start
        seq.window_from = replay_start
        seq.reuse_below = cached
