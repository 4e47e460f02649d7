"""Speculative verify and draft steps replayed from CUDA graphs, one pair per batch-size bucket.

A verify step in which every sequence decodes (its last token and at most K drafts, no prefill chunk beside it)
has a fixed shape once each sequence is given exactly K + 1 positions: the target's verify forward
(``ServedModel.verify_forward``) and the drafter's next drafts (``Drafter.draft_fixed``) then run from device
tensors alone, so each is recorded once per bucket, as plain decode steps are
(:mod:`dsinfer.engine.decode_graphs`), and replayed. A step of ``B`` sequences runs in the smallest bucket
``>= B``: the rows past ``B`` are padding that runs in the cache's spare slot against the trash block, and a
sequence with fewer than K drafts gets filler drafts that are never judged and always rolled back (their entries
of blocks it does not own go to the trash block, through block tables padded with it).

Between the two graphs the host judges the drafts (:mod:`dsinfer.speculative.verify`, from the verify graph's
logits) and rolls back rejected positions (:mod:`dsinfer.speculative.rollback`, from the snapshot taken before the
replay and the padded journal the verify graph writes). Static buffers hold the step's inputs (one copy from
the host per graph) and every output (logits, what the drafter reads, the journal, the drafts), shared by all
buckets. Without capture (``capture=False``: CPU, tests) the same buffers and padding run eagerly.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from dsinfer.graph_capture import capture_graph
from dsinfer.kv.batch import SequenceSpan, host_into_device, host_to_device
from dsinfer.kv.fixed_width import FixedWidthBatch, PendingJournal
from dsinfer.speculative.drafting import Drafter
from dsinfer.speculative.rollback import PaddedJournal

logger = logging.getLogger(__name__)


@dataclass
class GraphedVerify:
    """One verify step in a bucket: what the host needs around the replays."""

    size: int  # the bucket
    spans: list[SequenceSpan]  # the step's spans at full width, block tables padded with the trash block
    token_ids: torch.Tensor  # [count * width] their ids on the device (filler drafts included)
    own_ids: list[list[int]]  # each span's last token and real drafts, on the host
    judged_rows: list[int] | None  # rows of the logits the judge reads; None: all of them (no filler)
    journal: PaddedJournal | None = None


class SpecGraphs:
    """Static-shape verify and draft steps for batches up to the largest bucket (see the module docstring)."""

    def __init__(
        self, drafter: Drafter, cache, sizes: tuple[int, ...], spare_slot: int, max_model_len: int, capture: bool
    ) -> None:
        self.drafter, self.cache, self.spare_slot, self.capture = drafter, cache, spare_slot, capture
        self.num_drafts = drafter.num_tokens
        self.width = self.num_drafts + 1
        self.sizes = tuple(sorted(set(sizes)))
        # Filler drafts may run past max_model_len: the tables have room for their (trash) entries.
        self.table_width = math.ceil((max_model_len + self.width) / cache.block_tokens)
        self.device = cache.layers[0].window.device
        largest = self.sizes[-1]
        # One row per sequence: ids [width] | start | slot | window_from | block table [table_width].
        self.inputs = torch.zeros(largest, self.width + 3 + self.table_width, dtype=torch.long, device=self.device)
        self.inputs.copy_(torch.tensor([self._padding_row()] * largest, dtype=torch.long))
        # One row per sequence: the token after each position [width] | how many positions it kept.
        self.draft_inputs = torch.zeros(largest, self.width + 1, dtype=torch.long, device=self.device)
        self.draft_inputs[:, self.width] = 1
        # Outputs, allocated by the first forward (before any capture) for the largest bucket.
        self.logits: torch.Tensor | None = None
        self.features: torch.Tensor | None = None
        self.records: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.drafts: torch.Tensor | None = None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = {}
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
        """Fill the verify graph's inputs for ``step`` (one copy from the host); the spans the rollback snapshots."""
        plan, width, trash = step.speculation, self.width, self.cache.trash_block
        count = len(step.spans)
        size = next(s for s in self.sizes if s >= count)
        rows, spans, own_ids, judged, offset = [], [], [], [], 0
        for index, span in enumerate(step.spans):
            ids = plan.token_ids[offset : offset + span.length]
            offset += span.length
            own_ids.append(ids)
            judged += range(index * width, index * width + len(ids))
            table = span.block_table + [trash] * max(0, self._blocks_needed(span) - len(span.block_table))
            spans.append(SequenceSpan(span.start, width, span.slot, table, span.reuse_below, span.window_from))
            rows += ids + [0] * (width - len(ids)) + [span.start, span.slot, span.window_from]
            rows += table + [trash] * (self.table_width - len(table))
        rows += self._padding_row() * (size - count)
        host_into_device(self.inputs[:size], rows)
        token_ids = self.inputs[:count, :width].reshape(-1)
        return GraphedVerify(size, spans, token_ids, own_ids, None if len(judged) == count * width else judged)

    def verify(self, run: GraphedVerify) -> torch.Tensor:
        """Run the verify forward; the logits the judge reads (each span's last token and real drafts, in order).
        Sets ``run.journal``. The tensors are the graphs' buffers: valid until the next step's verify."""
        if self.capture:
            self.graphs[run.size][0].replay()
        else:
            self._verify_forward(run.size)
        count = len(run.spans)
        run.journal = PaddedJournal(self.records).first(count)
        logits = self.logits[: count * self.width]
        if run.judged_rows is not None:
            logits = logits.index_select(0, host_to_device(run.judged_rows, torch.long, self.device))
        return logits

    def draft(self, run: GraphedVerify, outputs) -> list[list[int]]:
        """The next drafts of every sequence after judging (``outputs``: accepted counts and emitted tokens) and
        rolling back; one host read."""
        width, count = self.width, len(run.spans)
        rows = []
        for ids, output in zip(run.own_ids, outputs, strict=True):
            kept = 1 + output.num_accepted
            rows += ids[1:kept] + [output.token_ids[-1]] + [0] * (width - kept) + [kept]
        rows += ([0] * width + [1]) * (run.size - count)
        host_into_device(self.draft_inputs[: run.size], rows)
        if self.capture:
            self.graphs[run.size][1].replay()
        else:
            self._draft_forward(run.size)
        return [row[: row[-1]] for row in self.drafts[:count].tolist()]  # the drafts' one host read

    # ---- internals ------------------------------------------------------------------------------------
    def _blocks_needed(self, span: SequenceSpan) -> int:
        return math.ceil((span.start + self.width) / self.cache.block_tokens)

    def _padding_row(self) -> list[int]:
        """A row that runs positions 0 .. width - 1 of the spare slot against the trash block."""
        return [0] * self.width + [0, self.spare_slot, 0] + [self.cache.trash_block] * self.table_width

    def _batch(self, size: int) -> FixedWidthBatch:
        inputs, width = self.inputs[:size], self.width

        def column(index: int) -> torch.Tensor:
            return inputs[:, index].contiguous()

        return FixedWidthBatch(inputs[:, :width].contiguous(), column(width), column(width + 1), column(width + 2),
                               inputs[:, width + 3 :].contiguous(), self.cache, self.spare_slot)  # fmt: skip

    def _verify_forward(self, size: int) -> None:
        batch = self._batch(size)
        journal = PendingJournal(batch)
        logits, features = self.drafter.model.verify_forward(batch, journal)
        rows = size * self.width
        if self.logits is None:  # the first forward (the largest bucket's warm-up on CUDA) sizes the outputs
            largest = self.sizes[-1]
            self.logits = logits.new_empty(largest * self.width, *logits.shape[1:])
            self.features = features.new_empty(largest * self.width, *features.shape[1:])
            self.records = {key: (v.new_zeros(largest, *v.shape[1:]), g.new_zeros(largest, *g.shape[1:]))
                            for key, (v, g) in journal.records.items()}  # fmt: skip
        self.logits[:rows].copy_(logits)
        self.features[:rows].copy_(features)
        for key, (values, gates) in journal.records.items():
            self.records[key][0][:size].copy_(values)
            self.records[key][1][:size].copy_(gates)

    def _draft_forward(self, size: int) -> None:
        batch = self._batch(size)
        inputs = self.draft_inputs[:size]
        next_ids, kept = inputs[:, : self.width].contiguous(), inputs[:, self.width].contiguous()
        drafts = self.drafter.draft_fixed(batch, self.features[: size * self.width], next_ids, kept)
        if self.drafts is None:
            self.drafts = drafts.new_zeros(self.sizes[-1], *drafts.shape[1:])
        self.drafts[:size].copy_(drafts)

    def _capture_all(self) -> None:
        """Record every bucket's verify and draft steps (largest first, sharing one memory pool), every row
        padding. The verify graph runs once before the draft's capture: the draft reads what it wrote."""
        pool = None
        for size in reversed(self.sizes):
            verify, _ = capture_graph(lambda size=size: self._verify_forward(size), pool)
            pool = verify.pool()
            verify.replay()
            draft, _ = capture_graph(lambda size=size: self._draft_forward(size), pool)
            self.graphs[size] = (verify, draft)
        torch.cuda.synchronize()
        logger.info("speculative CUDA graphs captured for batch sizes %s, %d positions per sequence",
                    list(self.sizes), self.width)  # fmt: skip
