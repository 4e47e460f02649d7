"""Decode steps replayed from CUDA graphs, one per batch-size bucket (vLLM's ``--cuda-graph-sizes``).

A decode step (one token per sequence) of either model is driven by device tensors alone (V4.1's Engram rows,
history and FP8 / FP4 cache writes included), so it can be recorded once and replayed: the host then issues
one launch instead of several hundred small kernels per layer, which is most of an eager step's time at small
batches. Each bucket owns static input buffers (token ids, positions, state slots, window starts, block tables
at full width, sample rows) and the logits the graph writes. A step of ``B`` sequences runs in the smallest
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

from dsinfer.kv.batch import DeviceSpans, PackedBatch, SequenceSpan, host_to_device

logger = logging.getLogger(__name__)


def capture_graph(forward, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Record ``forward()`` into a CUDA graph: two runs on a side stream first (compile the kernels, settle the
    allocator outside the capture), then the capture in ``pool`` (None: a new one; pass ``graph.pool()`` of an
    earlier graph to share memory between graphs that never run at once). Returns the graph and what the
    captured call returned (tensors the replays overwrite)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = forward()
    return graph, output


def default_graph_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two up to ``max_num_seqs``, and ``max_num_seqs`` itself."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return (*sizes, max_num_seqs)


class DecodeGraphs:
    """Static-shape decode for batches up to the largest bucket; ``run`` returns the sampled rows' logits."""

    def __init__(self, model, cache, sizes: tuple[int, ...], spare_slot: int, max_model_len: int, capture: bool):
        self.model, self.cache, self.spare_slot, self.capture = model, cache, spare_slot, capture
        self.sizes = tuple(sorted(set(sizes)))
        self.table_width = math.ceil(max_model_len / cache.block_tokens)
        device = cache.layers[0].window.device
        largest = self.sizes[-1]

        def buffer(fill: int, *shape: int) -> torch.Tensor:
            return torch.full((largest, *shape), fill, dtype=torch.long, device=device)

        self.input_ids = buffer(0)
        self.positions = buffer(0)
        self.slots = buffer(spare_slot)
        self.window_from = buffer(0)
        self.block_tables = buffer(cache.trash_block, self.table_width)
        self.rows = torch.arange(largest, dtype=torch.long, device=device)
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

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[SequenceSpan], size: int | None = None
    ) -> torch.Tensor:
        """Logits [B, vocab] of the step's sequences (a fresh tensor: the graph's output is reused).

        ``size``: the bucket to run (default: the smallest that holds the step). Expert-parallel ranks pass the
        bucket they agreed on, and a rank with no sequences runs it with every row padding (``spans`` empty)."""
        count = len(spans)
        if size is None:
            size = next(s for s in self.sizes if s >= count)
        elif size not in self.sizes or size < count:
            raise ValueError(f"bucket {size} cannot run {count} sequences (buckets {list(self.sizes)})")
        self._fill(input_ids, positions, spans, size)
        if self.capture:
            graph, logits = self.graphs[size]
            graph.replay()
            return logits[:count].clone()
        return self._forward(size)[:count]

    # ---- internals ------------------------------------------------------------------------------------
    def _fill(self, input_ids: torch.Tensor, positions: torch.Tensor, spans: list[SequenceSpan], size: int) -> None:
        count, device = len(spans), self.input_ids.device
        padding = size - count
        self.input_ids[:count].copy_(input_ids)
        self.positions[:count].copy_(positions)
        slots = [span.slot for span in spans] + [self.spare_slot] * padding
        window_from = [span.window_from for span in spans] + [0] * padding
        trash = self.cache.trash_block
        tables = [span.block_table + [trash] * (self.table_width - len(span.block_table)) for span in spans]
        tables += [[trash] * self.table_width] * padding
        self.slots[:size].copy_(host_to_device(slots, torch.long, device))
        self.window_from[:size].copy_(host_to_device(window_from, torch.long, device))
        self.block_tables[:size].copy_(host_to_device(tables, torch.long, device))
        if padding:
            self.input_ids[count:size].zero_()
            self.positions[count:size].zero_()

    def _batch(self, size: int) -> PackedBatch:
        spans = [SequenceSpan(0, 1, self.spare_slot, []) for _ in range(size)]  # host side: only the shape counts
        batch = PackedBatch(self.input_ids[:size], self.positions[:size], spans, self.cache)
        batch._device_spans = DeviceSpans(
            slots=self.slots[:size],
            starts=self.positions[:size],
            window_from=self.window_from[:size],
            block_tables=self.block_tables[:size],
            token_rows=self.rows[:size],
        )
        return batch

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self._batch(size), logits_for=self.rows[:size])

    def _capture_all(self) -> None:
        """Record every bucket (largest first, sharing one memory pool), with every row padding."""
        pool = None
        for size in reversed(self.sizes):
            graph, logits = capture_graph(lambda size=size: self._forward(size), pool)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()
        logger.info("decode CUDA graphs captured for batch sizes %s", list(self.sizes))
