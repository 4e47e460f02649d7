"""Runs the model for one scheduled step: builds the packed batch over the engine's cache, returns logits.

A step is run in two halves. :meth:`ModelRunner.prepare` runs on the engine thread and turns the scheduled
sequences into plain data (token ids, positions, spans with copied block tables) while the sequences still
describe this step. :meth:`ModelRunner.execute` runs on the device worker and is the only place that writes
the cache, so steps write it strictly in order however far ahead the scheduler plans.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass

import torch

from dsinfer.config import EngineConfig
from dsinfer.engine.cache_plan import CachePlan, ServedModel, cache_blocks_for_budget, check_served_model
from dsinfer.engine.decode_graphs import DecodeGraphs, default_graph_sizes
from dsinfer.engine.image_spans import ImageEmbeddings, ImagePiece, image_pieces
from dsinfer.engine.scheduler import ScheduledSequence
from dsinfer.engram.hashing import ENGRAM_DEAD
from dsinfer.kv.batch import PackedBatch, SequenceSpan, host_to_device
from dsinfer.speculative.executor import SpeculationPlan

logger = logging.getLogger(__name__)

# A mixed step (decodes and prefill chunks together) whose leading decode rows number at least this many runs them
# as a decode forward of their own (a graph replay where a bucket holds them) beside the chunks' forward: the
# prefill path's compressors and indexer run sequence by sequence, a few small kernels a layer each, which past
# a few sequences costs more than the second read of the weights.
MIXED_STEP_DECODE_SPLIT_ROWS = 4


@dataclass
class EngramResume:
    """Sequences entering their slot past position 0: their slots and the tokens just before their start."""

    slots: list[int]
    earlier_tokens: list[list[int]]  # at most ``max_ngram_size - 1`` tokens each


@dataclass
class PendingFill:
    """Input rows of a step launched ahead of the previous step's host read: their ids are that step's sampled
    tokens, copied on the device just before the forward (placeholders until then)."""

    count: int
    rows: torch.Tensor | None = None  # rows of ``input_ids``; None: the first ``count``
    sources: torch.Tensor | None = None  # rows of the previous step's sampled tokens; None: the first ``count``

    def apply(self, input_ids: torch.Tensor, sampled: torch.Tensor) -> None:
        """Write the fill into ``input_ids`` from ``sampled``, the previous step's chosen ids (on the device)."""
        if self.rows is None:  # the steady decode step: one copy, no index tensors
            input_ids[: self.count].copy_(sampled[: self.count])
        else:
            input_ids[self.rows] = sampled[self.sources]


@dataclass
class StepInput:
    """One scheduled step as plain data, ready for :meth:`ModelRunner.execute`."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    spans: list[SequenceSpan]
    sample_rows: torch.Tensor  # [k] rows of the sequences whose last token runs (their logits are returned)
    engram_resume: EngramResume | None = None
    image_pieces: list[ImagePiece] | None = None  # V4.1: the parts of image spans this step's rows hold
    speculation: SpeculationPlan | None = (
        None  # speculative decoding: each span's drafts (dsinfer.speculative.executor)
    )
    pending_fill: PendingFill | None = None  # launched ahead: ids the device worker fills in before the forward


def _wants_graphs(model: ServedModel, engine: EngineConfig) -> bool:
    """Static-shape steps (decode graphs; with speculative decoding, verify and draft graphs instead) need the
    batched decode path and a model whose steps nothing keeps out of a graph (a routed-experts backend that
    syncs, an Engram source whose step-sized fetches read through the host: the model says).

    On CUDA they are on unless ``enforce_eager``; on the CPU only an explicit ``cuda_graph_sizes`` asks for the
    same static-shape path, run eagerly (how the tests check it)."""
    if engine.enforce_eager:
        return False
    device = torch.device(engine.device)
    if device.type != "cuda":
        return engine.cuda_graph_sizes is not None
    spec = engine.speculative_config
    positions = 1 if spec is None else 1 + spec.num_speculative_tokens  # per sequence and step
    largest = max(engine.cuda_graph_sizes or (engine.max_num_seqs,)) * positions
    reason = model.graph_capture_blocker(device, largest)
    if reason is not None:
        logger.info("decode CUDA graphs off: %s", reason)
        return False
    return True


class ModelRunner:
    """Owns the model replica's cache (V4 or V4.1, sized from the engine's budget) and runs prepared steps."""

    def __init__(self, model: ServedModel, engine: EngineConfig, max_model_len: int) -> None:
        check_served_model(model)
        self.model = model
        self.device = torch.device(engine.device)
        self.block_tokens = model.cache_block_tokens(engine.block_tokens)
        graphed = _wants_graphs(model, engine)
        num_slots = engine.max_num_seqs + (1 if graphed else 0)  # the spare slot padding rows decode in
        num_blocks = cache_blocks_for_budget(model, engine, num_slots, self.block_tokens)
        needed = math.ceil(max_model_len / self.block_tokens)
        if num_blocks < needed:
            raise ValueError(
                f"cache budget too small: {num_blocks} blocks of {self.block_tokens} tokens cannot hold one sequence "
                f"of max_model_len {max_model_len} ({needed} blocks); raise the cache budget or lower max_model_len"
            )
        self.speculative = engine.speculative_config is not None
        self.replay_tokens = model.bounded_replay_tokens(engine)
        self.cache = model.build_cache(
            CachePlan(num_slots, num_blocks, self.block_tokens, self.device, self.speculative, engine.kv_cache_dtype)
        )
        self._engram_width = model.engram_history_width()
        self.max_model_len = max_model_len
        # Static-shape steps: the buckets, the spare slot their padding rows run in, whether to capture graphs.
        self.graph_sizes: tuple[int, ...] | None = None
        self.spare_slot, self.capture_graphs = engine.max_num_seqs, self.device.type == "cuda"
        self.float32 = engine.dtype == "float32"  # the model's dtype: which BLAS each graph records under
        self.decode_graphs: DecodeGraphs | None = None
        if graphed:
            sizes = engine.cuda_graph_sizes or default_graph_sizes(engine.max_num_seqs)
            self.graph_sizes = tuple(size for size in sizes if size <= engine.max_num_seqs) or (engine.max_num_seqs,)
        if graphed and not self.speculative:  # speculative steps have their own (dsinfer.speculative.graphs)
            self.decode_graphs = DecodeGraphs(model, self.cache, self.graph_sizes, self.spare_slot, max_model_len,
                                              self.capture_graphs, self.float32)  # fmt: skip
        self.image_embeddings = ImageEmbeddings(model) if getattr(model.config, "vision", None) else None
        # Mixed steps may run as two forwards (MIXED_STEP_DECODE_SPLIT_ROWS); expert-parallel ranks turn this off,
        # since their forwards pair up collective by collective.
        self.split_mixed_steps = True

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    def prepare(self, scheduled: list[ScheduledSequence], pending_rows: dict[int, int] | None = None) -> StepInput:
        """Read the scheduled sequences as they are now (before their bookkeeping advances) into a step.

        ``pending_rows`` maps ``id(seq)`` to the row a step still on the device samples that sequence's newest
        token in: that token is not on the host yet, so its input row gets a placeholder the device worker
        replaces (:attr:`StepInput.pending_fill`)."""
        ids, positions, spans, sample_rows, pieces = [], [], [], [], []
        drafts, following, fill_rows, fill_sources = [], [], [], []
        offset = 0
        for item in scheduled:
            seq, start, count = item.seq, item.seq.num_computed, item.num_new_tokens
            known = count - item.num_draft_tokens  # the drafts run behind the sequence's own tokens
            if seq.images:
                pieces += image_pieces(seq.images, start, count, offset)
            own = seq.tokens_between(start, start + known)
            if len(own) < known:  # the newest token is still being sampled: filled on the device
                if pending_rows is None or id(seq) not in pending_rows or len(own) != known - 1:
                    raise RuntimeError(f"sequence {seq.request_id}: its step needs tokens the host does not have")
                fill_rows.append(offset + known - 1)
                fill_sources.append(pending_rows[id(seq)])
                own = own + [0]
            ids += own + seq.draft_token_ids[: item.num_draft_tokens]
            positions += range(start, start + count)
            table = seq.block_table_now()  # the scheduler may grow or drop the live list before this step runs
            decoder_from = max(0, len(seq.prompt_token_ids) - self.replay_tokens) if self.replay_tokens else 0
            spans.append(
                SequenceSpan(
                    start,
                    count,
                    seq.slot,
                    table,
                    seq.reuse_below,
                    seq.window_from,
                    decoder_from,
                    table_token=seq.table_token,
                )
            )
            if item.completes_sequence:
                sample_rows += range(offset + known - 1, offset + count)  # the last token's row and the drafts'
            offset += count
            drafts.append(list(seq.draft_token_ids[: item.num_draft_tokens]))
            after = start + count
            following.append(None if item.completes_sequence else seq.tokens_between(after, after + 1)[0])
        prefix = bool(fill_rows) and fill_rows == fill_sources == list(range(len(fill_rows)))
        lists = [ids, positions, sample_rows] + ([fill_rows, fill_sources] if fill_rows and not prefix else [])
        flat = [value for values in lists for value in values]  # one copy to the device for all of them
        device_lists = host_to_device(flat, torch.long, self.device).split([len(values) for values in lists])
        fill = PendingFill(len(fill_rows), *device_lists[3:]) if fill_rows else None
        return StepInput(
            device_lists[0],
            device_lists[1],
            spans,
            device_lists[2],
            self._engram_resume(scheduled),
            pieces or None,
            SpeculationPlan(drafts, following, ids) if self.speculative else None,
            fill,
        )

    def before_step(self) -> None:
        """Between steps: a model with offloaded experts may re-balance its resident sets (never inside a
        forward, which a CUDA graph may replay)."""
        offload = getattr(self.model, "expert_offload", None)
        if offload is not None:
            offload.before_step()

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Compute a prepared step over the cache; logits [k, vocab] for its sampled sequences."""
        graphs = self.decode_graphs
        plain = step.engram_resume is None and not step.image_pieces  # a graph holds only the decode forward
        if graphs is not None and plain and graphs.serves(step.spans, int(step.sample_rows.shape[0])):
            return graphs.run(step.input_ids, step.spans)
        decodes = self.leading_decodes(step) if plain and self.split_mixed_steps else 0
        if decodes >= MIXED_STEP_DECODE_SPLIT_ROWS:
            return self._execute_split(step, decodes)
        return self.model(self.step_batch(step), logits_for=step.sample_rows)

    @staticmethod
    def leading_decodes(step: StepInput) -> int:
        """How many of a mixed step's first spans decode one token each, ahead of a prefill chunk (0: the step
        is not mixed). The scheduler puts decodes first; each samples its row (a one-token chunk that does not end
        its prompt takes the step's last tokens of budget, so it comes last)."""
        count = 0
        for span in step.spans:
            if span.length != 1:
                break
            count += 1
        mixed = count < len(step.spans) and count <= int(step.sample_rows.shape[0])
        return count if mixed else 0

    def _execute_split(self, step: StepInput, decodes: int) -> torch.Tensor:
        """A mixed step as two forwards: the leading ``decodes`` one-token spans on the decode path (their graph
        where a bucket holds them), then the prefill chunks; their logits in the step's sample order."""
        ids, positions, spans = step.input_ids, step.positions, step.spans
        head, tail = spans[:decodes], spans[decodes:]
        graphs = self.decode_graphs
        if graphs is not None and graphs.serves(head, decodes):
            decoded = graphs.run(ids[:decodes], head)
        else:
            rows = torch.arange(decodes, device=ids.device)
            decoded = self.model(PackedBatch(ids[:decodes], positions[:decodes], head, self.cache), logits_for=rows)
        chunks = PackedBatch(ids[decodes:], positions[decodes:], tail, self.cache)
        prefilled = self.model(chunks, logits_for=step.sample_rows[decodes:] - decodes)
        return torch.cat([decoded, prefilled])

    def step_batch(self, step: StepInput) -> PackedBatch:
        """The step's packed batch over the cache, once what its forward needs first is done: the Engram history
        of sequences entering their slot past position 0 rebuilt, image spans encoded. Every forward of a
        prepared step (plain or speculative) starts here, on the device worker."""
        if step.engram_resume is not None:
            self._restore_engram_history(step.engram_resume)
        batch = PackedBatch(step.input_ids, step.positions, step.spans, self.cache)
        if step.image_pieces:  # encoded here, in the step that first needs them (batched across requests)
            batch.image_splice = self.image_embeddings.splice(step.image_pieces, self.device)
        return batch

    # ---- Engram history after a prefix-cache hit ----------------------------------------------------------
    def _engram_resume(self, scheduled: list[ScheduledSequence]) -> EngramResume | None:
        """The sequences whose Engram history must be rebuilt before this step, with the tokens it needs.

        The model starts a span from an empty Engram context only at position 0; a later span continues from
        its slot's ``engram_history``. After a prefix-cache hit a sequence's first step starts at its replay
        position (``num_computed == window_from > 0``) in a slot whose history still describes the slot's
        previous occupant. (A preempted sequence restarts at 0, which the model handles, or at a replay
        position when its own prefix is still cached, which lands here too.)
        """
        if not self._engram_width:
            return None
        entering = [item.seq for item in scheduled if item.seq.num_computed == item.seq.window_from > 0]
        if not entering:
            return None
        width = self._engram_width
        earlier = [seq.tokens_between(max(0, seq.num_computed - width), seq.num_computed) for seq in entering]
        return EngramResume([seq.slot for seq in entering], earlier)

    def _restore_engram_history(self, resume: EngramResume) -> None:
        """Write the Engram context of each entering sequence's earlier tokens into its slot."""
        hasher = self.model.engram_hasher
        if hasher is None:
            return  # the forward raises, naming the missing hasher
        history = self.cache.engram_history
        device = history.device
        flat = [t for ids in resume.earlier_tokens for t in ids]  # the sequences' own (checked) tokens
        lengths = [len(ids) for ids in resume.earlier_tokens]
        tokens = host_to_device(flat, torch.long, device)
        ends = host_to_device(list(itertools.accumulate(lengths)), torch.long, device)
        empty = torch.full((len(lengths), self._engram_width), ENGRAM_DEAD, dtype=torch.long, device=device)
        _, contexts = hasher.prefill_step(tokens, lengths, empty, ends)  # no host read: this runs in the step
        history[host_to_device(resume.slots, torch.long, device)] = contexts
