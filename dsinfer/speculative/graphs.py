"""Speculative verify steps replayed from CUDA graphs, one pair per batch-size bucket, with one host read a step.

A verify step in which every sequence decodes (its last token and at most K drafts, no prefill chunk beside it)
has a fixed shape once each sequence is given exactly K + 1 positions, so everything between the host's inputs
and the step's result runs from device tensors alone and is recorded once per bucket, as plain decode steps are
(:mod:`dsinfer.engine.decode_graphs`), and replayed:

1. the **verify graph**: the snapshot of what the step may overwrite
   (:class:`~dsinfer.speculative.fixed_rollback.FixedWidthRollback`), the target's verify forward
   (``ServedModel.verify_forward``) and the greedy judge (:func:`~dsinfer.speculative.verify.judge_greedy_fixed`:
   accepted counts and the token after them); when a sequence samples or has stop tokens masked by
   ``min_tokens``, a **judge graph** after it judges every sequence from the verify logits
   (:class:`~dsinfer.speculative.fixed_judge.FixedJudge`: rejection sampling with the host judge's noise keys);
2. the **draft graph**: the rollback of rejected positions from those accepted counts, then the drafter's next
   drafts (``Drafter.draft_fixed``) from the kept positions.

The host then reads the step's result once (accepted counts, tokens, next drafts: one row per sequence). A step
with a sequence the device judge cannot decide (a grammar, penalties, logprobs; see
:func:`~dsinfer.speculative.fixed_judge.judged_on_device`) is judged on the host between the two replays, from the
verify graph's logits, and its accepted counts and tokens are copied into the draft graph's input.

A step of ``B`` sequences runs in the smallest bucket ``>= B``: the rows past ``B`` are padding that runs in the
cache's spare slot against the trash block, and a sequence with fewer than K drafts gets filler drafts that are
never accepted and always rolled back (their entries of blocks it does not own go to the trash block, through
block tables padded with it). Static buffers hold the step's inputs (one copy from the host) and every output
(logits, what the drafter reads, the journal, the snapshot, the result), shared by all buckets. Without capture
(``capture=False``: CPU, tests) the same buffers and padding run eagerly.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from dsinfer.graph_capture import blas_for_rows, capture_graph, release_graphs
from dsinfer.kv.batch import SequenceSpan, host_into_device, host_to_device
from dsinfer.kv.fixed_width import FixedWidthBatch, PendingJournal
from dsinfer.speculative.drafting import Drafter
from dsinfer.speculative.fixed_judge import FixedJudge, JudgeMode
from dsinfer.speculative.fixed_rollback import FixedWidthRollback
from dsinfer.speculative.phase_clock import PhaseClock
from dsinfer.speculative.rollback import CacheRollback
from dsinfer.speculative.verify import judge_greedy_fixed

logger = logging.getLogger(__name__)

# The verify graph's input row of one sequence: ids [width] | start | slot | window_from | drafts | block table.
_FIELDS = 4


@dataclass
class GraphedVerify:
    """One verify step in a bucket: what the host needs around the replays."""

    size: int  # the bucket
    spans: list[SequenceSpan]  # the step's spans at full width, block tables padded with the trash block
    own_ids: list[list[int]]  # each span's last token and real drafts, on the host
    judged_rows: list[int] | None  # rows of the logits a host judge reads; None: all of them (no filler)
    mode: JudgeMode = JudgeMode.ARGMAX  # the device's judge (the host's, when it overrides it)


@dataclass
class StepResult:
    """One sequence's result of a graphed step, from the step's one host read."""

    num_accepted: int
    last_token: int  # the token after the accepted drafts
    next_drafts: list[int]


class SpecGraphs:
    """Static-shape verify and draft steps for batches up to the largest bucket (see the module docstring)."""

    def __init__(self, drafter: Drafter, rollback: CacheRollback, sizes: tuple[int, ...], spare_slot: int,
                 max_model_len: int, capture: bool, float32: bool = False) -> None:  # fmt: skip
        cache = rollback.cache
        self.drafter, self.cache, self.spare_slot, self.capture = drafter, cache, spare_slot, capture
        self.float32 = float32  # the model's linears are float32 (which BLAS each graph records under)
        self.fixed_rollback = FixedWidthRollback(rollback)
        self.num_drafts = drafter.num_tokens
        self.width = self.num_drafts + 1
        self.sizes = tuple(sorted(set(sizes)))
        # Filler drafts may run past max_model_len: the tables have room for their (trash) entries.
        self.table_width = math.ceil((max_model_len + self.width) / cache.block_tokens)
        self.device = cache.layers[0].window.device
        largest = self.sizes[-1]
        self.inputs = torch.zeros(largest, self.width + _FIELDS + self.table_width, dtype=torch.long,
                                  device=self.device)  # fmt: skip
        self._stage_padding()
        # The step's result, one row per sequence: accepted | the token after them | next drafts [K] | how many
        # of them to verify. The verify graph (or the host's judge) writes the first two, the draft graph the rest.
        self.result = torch.zeros(largest, 3 + self.num_drafts, dtype=torch.long, device=self.device)
        self.drafts = self.result[:, 2:]
        self.judge = FixedJudge(largest, self.device)  # the judge graphs' inputs
        # Outputs, allocated by the first forward (before any capture) for the largest bucket.
        self.logits: torch.Tensor | None = None
        self.features: torch.Tensor | None = None
        self.records: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.saved: list[torch.Tensor] | None = None  # the snapshot
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = {}
        self.judge_graphs: dict[tuple[int, JudgeMode], torch.cuda.CUDAGraph] = {}
        self.phase_clock: PhaseClock | None = None  # a benchmark's split of each step (start_phase_clock)
        if capture:
            self._capture_all()

    # ---- which steps fit ----------------------------------------------------------------------------
    def serves(self, step) -> bool:
        """Every sequence decodes (its last token and at most K drafts, sampled), no Engram history to rebuild or
        image to encode first, few enough sequences for a bucket."""
        plan = step.speculation
        if plan is None or step.engram_resume is not None or step.image_pieces:
            return False
        if not 0 < len(step.spans) <= self.sizes[-1]:
            return False
        for span, drafts, following in zip(step.spans, plan.drafts, plan.following_token, strict=True):
            if following is not None or len(drafts) > self.num_drafts or span.length != 1 + len(drafts):
                return False
            if span.decoder_from or max(self._blocks_needed(span), len(span.block_table)) > self.table_width:
                return False
        return True

    # ---- a step ---------------------------------------------------------------------------------------
    def prepare(self, step) -> GraphedVerify:
        """Fill the verify graph's inputs for ``step`` (one copy from the host)."""
        plan, width, trash = step.speculation, self.width, self.cache.trash_block
        count = len(step.spans)
        size = next(s for s in self.sizes if s >= count)
        rows, spans, own_ids, judged, offset = [], [], [], [], 0
        for index, span in enumerate(step.spans):
            ids = plan.token_ids[offset : offset + span.length]
            offset += span.length
            own_ids.append(ids)
            judged += range(index * width, index * width + len(ids))
            table = [*span.block_table] + [trash] * max(0, self._blocks_needed(span) - len(span.block_table))
            spans.append(SequenceSpan(span.start, width, span.slot, table, span.reuse_below, span.window_from))
            rows += ids + [0] * (width - len(ids)) + [span.start, span.slot, span.window_from, len(ids) - 1]
            rows += table + [trash] * (self.table_width - len(table))
        rows += self._padding_row() * (size - count)
        host_into_device(self.inputs[:size], rows)
        return GraphedVerify(size, spans, own_ids, None if len(judged) == count * width else judged)

    def plan_judge(self, run: GraphedVerify, states: list) -> bool:
        """Whether the device judges every sequence of the step (``states``: the spans' sampling states, in
        order); if so, the judge's inputs are filled and ``run.mode`` says which judge graph replays."""
        mode = self.judge.plan(states, run.size, self.width)
        run.mode = mode or JudgeMode.ARGMAX
        return mode is not None

    def start_phase_clock(self) -> PhaseClock:
        """Time every later step's verify and draft replays apart (a benchmark's; :mod:`.phase_clock`)."""
        self.phase_clock = PhaseClock(self.device)
        return self.phase_clock

    def verify(self, run: GraphedVerify) -> None:
        """Snapshot, verify forward and greedy judge of the step (the verify graph's replay), then the sampled
        judge when the step needs it (the judge graph's)."""
        if self.phase_clock is not None:
            self.phase_clock.mark()
        if self.capture:
            self.graphs[run.size][0].replay()
            if run.mode is not JudgeMode.ARGMAX:
                self.judge_graphs[run.size, run.mode].replay()
        else:
            self._verify_forward(run.size)
            if run.mode is not JudgeMode.ARGMAX:
                self._judge_forward(run.size, run.mode)
        if self.phase_clock is not None:
            self.phase_clock.mark()

    def judged_logits(self, run: GraphedVerify) -> torch.Tensor:
        """The logits a host judge reads (each span's last token and real drafts, in order): the graphs' buffer,
        valid until the next step's verify."""
        logits = self.logits[: len(run.spans) * self.width]
        if run.judged_rows is not None:
            logits = logits.index_select(0, host_to_device(run.judged_rows, torch.long, self.device))
        return logits

    def take_judgement(self, run: GraphedVerify, judged: list[tuple[int, int]]) -> None:
        """The host's judgement (accepted drafts, the token after them) of every sequence, in place of the
        device's, for the draft graph (one copy)."""
        rows = [[accepted, token] + [0] * (self.num_drafts + 1) for accepted, token in judged]
        host_into_device(self.result[: len(run.spans)], [value for row in rows for value in row])

    def finish(self, run: GraphedVerify) -> list[StepResult]:
        """Roll back and draft (the draft graph's replay); then the step's one host read."""
        if self.capture:
            self.graphs[run.size][1].replay()
        else:
            self._draft_forward(run.size)
        if self.phase_clock is not None:
            self.phase_clock.mark()
        rows = self.result[: len(run.spans)].tolist()  # the step's one host read
        if self.phase_clock is not None:
            self.phase_clock.close_step()
        return [StepResult(row[0], row[1], row[2 : 2 + row[-1]]) for row in rows]

    # ---- internals ------------------------------------------------------------------------------------
    def _blocks_needed(self, span: SequenceSpan) -> int:
        return math.ceil((span.start + self.width) / self.cache.block_tokens)

    def _stage_padding(self) -> None:
        """Every row of the verify graph's inputs a padding row (:meth:`_padding_row`)."""
        self.inputs.copy_(torch.tensor([self._padding_row()] * self.sizes[-1], dtype=torch.long))

    def _padding_row(self) -> list[int]:
        """A row that runs positions 0 .. width - 1 of the spare slot against the trash block, with no draft."""
        return [0] * self.width + [0, self.spare_slot, 0, 0] + [self.cache.trash_block] * self.table_width

    def _batch(self, size: int) -> FixedWidthBatch:
        inputs, width = self.inputs[:size], self.width

        def column(index: int) -> torch.Tensor:
            return inputs[:, index].contiguous()

        return FixedWidthBatch(inputs[:, :width].contiguous(), column(width), column(width + 1), column(width + 2),
                               inputs[:, width + _FIELDS :].contiguous(), self.cache, self.spare_slot)  # fmt: skip

    def _verify_forward(self, size: int) -> None:
        batch, first = self._batch(size), self.logits is None
        # After the first forward the snapshot and the journal's records go straight into the static buffers.
        saved_into, records_into = (None, None) if first else self._snapshot_buffers(size)
        saved = self.fixed_rollback.snapshot(batch, saved_into)
        journal = PendingJournal(batch, records_into)
        logits, features = self.drafter.model.verify_forward(batch, journal)
        rows = size * self.width
        if first:  # the first forward (the largest bucket's warm-up on CUDA) sizes the outputs
            largest = self.sizes[-1]
            self.logits = logits.new_empty(largest * self.width, *logits.shape[1:])
            self.features = features.new_empty(largest * self.width, *features.shape[1:])
            self.records = {key: (v.new_zeros(largest, *v.shape[1:]), g.new_zeros(largest, *g.shape[1:]))
                            for key, (v, g) in journal.records.items()}  # fmt: skip
            self.saved = [tensor.new_zeros(largest, *tensor.shape[1:]) for tensor in saved]
            for key, (values, gates) in journal.records.items():
                self.records[key][0][:size].copy_(values)
                self.records[key][1][:size].copy_(gates)
            for buffer, tensor in zip(self.saved, saved, strict=True):
                buffer[:size].copy_(tensor)
        self.logits[:rows].copy_(logits)
        self.features[:rows].copy_(features)
        draft_counts = self.inputs[:size, self.width + 3]
        accepted, last = judge_greedy_fixed(logits, batch.input_ids[:, 1:], draft_counts)
        self.result[:size, 0].copy_(accepted)
        self.result[:size, 1].copy_(last)

    def _snapshot_buffers(self, size: int) -> tuple[list[torch.Tensor], dict]:
        """The first ``size`` rows of the snapshot's and the journal records' static buffers."""
        records = {key: (values[:size], gates[:size]) for key, (values, gates) in self.records.items()}
        return [buffer[:size] for buffer in self.saved], records

    def _judge_forward(self, size: int, mode: JudgeMode) -> None:
        """Every sequence's judgement from the verify logits, with the sampled and ``min_tokens`` inputs."""
        width = self.width
        draft_ids, draft_counts = self.inputs[:size, 1:width], self.inputs[:size, width + 3]
        accepted, last = self.judge.judge(self.logits[: size * width], draft_ids, draft_counts, mode)
        self.result[:size, 0].copy_(accepted)
        self.result[:size, 1].copy_(last)

    def _draft_forward(self, size: int) -> None:
        batch, width = self._batch(size), self.width
        accepted, last = self.result[:size, 0], self.result[:size, 1]
        saved, records = self._snapshot_buffers(size)
        self.fixed_rollback.rollback(batch, saved, records, accepted)
        # The token after each kept position: the accepted drafts, then the judged token; zeros past it.
        columns = torch.arange(width, device=accepted.device)[None, :]
        following = torch.cat([batch.input_ids[:, 1:], torch.zeros_like(batch.input_ids[:, :1])], dim=1)
        following = torch.where(columns < accepted[:, None], following, 0)
        following = following.scatter(1, accepted[:, None], last[:, None])
        drafts = self.drafter.draft_fixed(batch, self.features[: size * width], following, accepted + 1)
        self.result[:size, 2:].copy_(drafts)

    def recapture(self) -> None:
        """Record every bucket's graphs again, every row padding (the next step stages its own rows): a profiler
        sees the kernels of a graph's replays only when the graph was instantiated while it was recording, as
        :meth:`dsinfer.engine.decode_graphs.DecodeGraphs.recapture` says. Nothing a later step reads survives a
        round in the buffers (the drafts went to the host with the round's one read)."""
        if not self.capture:
            return
        release_graphs(self.device, self.graphs, self.judge_graphs)
        self._stage_padding()
        self._capture_all()

    def _capture_all(self) -> None:
        """Record every bucket's verify, judge and draft steps (largest first, sharing one memory pool), every row
        padding. The verify graph runs once before the others' capture: they read what it wrote."""
        pool = None
        for size in reversed(self.sizes):
            verify_blas = blas_for_rows(size * self.width, self.float32)  # K + 1 rows a sequence
            verify, _ = capture_graph(lambda size=size: self._verify_forward(size), pool, verify_blas)
            pool = verify.pool()
            verify.replay()
            for mode in (JudgeMode.FILTERED, JudgeMode.FILTERED_TOP):
                self.judge_graphs[size, mode], _ = capture_graph(lambda s=size, m=mode: self._judge_forward(s, m), pool)
            draft_blas = blas_for_rows(size, self.float32)  # drafts run one row a sequence at a time
            draft, _ = capture_graph(lambda size=size: self._draft_forward(size), pool, draft_blas)
            self.graphs[size] = (verify, draft)
        torch.cuda.synchronize()
        logger.info("speculative CUDA graphs captured for batch sizes %s, %d positions per sequence",
                    list(self.sizes), self.width)  # fmt: skip
