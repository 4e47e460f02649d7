"""Decode steps replayed from CUDA graphs, one per batch-size bucket (vLLM's ``--cuda-graph-sizes``).

A decode step (one token per sequence) of either model is driven by device tensors alone (V4.1's Engram rows,
history and FP8 / FP4 cache writes included), so it can be recorded once and replayed: the host then issues
one launch instead of several hundred small kernels per layer, which is most of an eager step's time at small
batches. Each bucket owns one static input buffer (token ids, positions, state slots, window starts, block
tables at full width, end to end), which a step fills with one copy from the host (staged by
:mod:`dsinfer.engine.graph_inputs`, block-table rows written only where they changed) and one of its token ids on
the device, and the logits the graph writes. A step of ``B`` sequences runs in the smallest
bucket ``>= B``; the rows past ``B`` are padding that decodes position 0 of the cache's spare slot, whose block
tables point at the trash block, so they touch nothing a sequence owns (V4.1: their Engram history is the spare
slot's). Graphs are captured when the runner is built, before any other thread uses the device, with every row
padding.

Without capture (``capture=False``: CPU, tests) the same buffers and padding run eagerly, which is how the
CPU test suite checks the padding and the static tables against plain decoding.
"""

from __future__ import annotations

import logging
import math

import torch

from dsinfer.engine.graph_inputs import StagedGraphInputs
from dsinfer.graph_capture import blas_for_rows, capture_graph, release_graphs
from dsinfer.kv.batch import DeviceSpans, PackedBatch, SequenceSpan

logger = logging.getLogger(__name__)


def default_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two up to ``max_num_seqs``, and ``max_num_seqs`` itself."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return (*sizes, max_num_seqs)


class DecodeGraphs:
    """Static-shape decode for batches up to the largest bucket; ``run`` returns the sampled rows' logits."""

    def __init__(self, model, cache, sizes: tuple[int, ...], spare_slot: int, max_model_len: int, capture: bool,
                 float32: bool = False) -> None:  # fmt: skip
        self.model, self.cache, self.spare_slot, self.capture = model, cache, spare_slot, capture
        self.float32 = float32  # the model's linears are float32 (which BLAS each bucket records under)
        self.sizes = tuple(sorted(set(sizes)))
        self.table_width = math.ceil(max_model_len / cache.block_tokens)
        device = cache.layers[0].window.device
        # Per bucket: ids | positions | slots | window starts (one row of the bucket's size each) | block tables.
        self.inputs = {size: torch.empty(size * (4 + self.table_width), dtype=torch.long, device=device)
                       for size in self.sizes}  # fmt: skip
        self.staged = StagedGraphInputs(self.sizes, self.table_width, cache.trash_block, spare_slot,
                                        pinned=device.type == "cuda")  # fmt: skip
        for size, inputs in self.inputs.items():
            self.staged.write(inputs, [], size)
        self.rows = torch.arange(self.sizes[-1], dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture_all()

    # ---- which steps fit ----------------------------------------------------------------------------
    def serves(self, spans: list[SequenceSpan], num_sample_rows: int) -> bool:
        """A pure decode step that samples every sequence, small enough for a bucket, tables within width."""
        return (
            0 < len(spans) <= self.sizes[-1]
            and num_sample_rows == len(spans)
            and all(span.length == 1 and len(span.block_table) <= self.table_width for span in spans)
        )

    def run(self, input_ids: torch.Tensor, spans: list[SequenceSpan], size: int | None = None) -> torch.Tensor:
        """Logits [B, vocab] of the step's sequences (a fresh tensor: the graph's output is reused); each span
        decodes one token at its ``start``, whose id is that row of ``input_ids`` (on the device).

        ``size``: the bucket to run (default: the smallest that holds the step). Expert-parallel ranks pass the
        bucket they agreed on, and a rank with no sequences runs it with every row padding (``spans`` empty)."""
        count = len(spans)
        if size is None:
            size = next(s for s in self.sizes if s >= count)
        elif size not in self.sizes or size < count:
            raise ValueError(f"bucket {size} cannot run {count} sequences (buckets {list(self.sizes)})")
        self.staged.write(self.inputs[size], spans, size)
        self._views(size)[0][:count].copy_(input_ids)
        if self.capture:
            graph, logits = self.graphs[size]
            graph.replay()
            return logits[:count].clone()
        return self._forward(size)[:count]

    # ---- internals ------------------------------------------------------------------------------------
    def _views(self, size: int) -> tuple[torch.Tensor, ...]:
        """Bucket ``size``'s ids, positions, slots, window starts ``[size]`` and block tables ``[size, width]``."""
        inputs = self.inputs[size]
        ids, positions, slots, window_from = inputs[: 4 * size].view(4, size)
        return ids, positions, slots, window_from, inputs[4 * size :].view(size, self.table_width)

    def _batch(self, size: int) -> PackedBatch:
        ids, positions, slots, window_from, block_tables = self._views(size)
        spans = [SequenceSpan(0, 1, self.spare_slot, []) for _ in range(size)]  # host side: only the shape counts
        batch = PackedBatch(ids, positions, spans, self.cache)
        batch._device_spans = DeviceSpans(slots, positions, window_from, block_tables, token_rows=self.rows[:size])
        return batch

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self._batch(size), logits_for=self.rows[:size])

    def recapture(self) -> None:
        """Record every bucket again, every row padding (the next step stages its own rows). A profiler sees the
        kernels of a graph's replays only when the graph was instantiated while it was recording (CUPTI instruments
        a graph's kernels when it is instantiated), so a profile of graphed steps recaptures first."""
        if not self.capture:
            return
        release_graphs(self.rows.device, self.graphs)
        for size, inputs in self.inputs.items():
            self.staged.write(inputs, [], size)
        self._capture_all()

    def _capture_all(self) -> None:
        """Record every bucket (largest first, sharing one memory pool), with every row padding."""
        pool = None
        for size in reversed(self.sizes):
            blas = blas_for_rows(size, self.float32)
            graph, logits = capture_graph(lambda size=size: self._forward(size), pool, blas)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("decode CUDA graphs captured for batch sizes %s", list(self.sizes))
