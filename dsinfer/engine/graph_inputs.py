"""A decode graph bucket's inputs staged on the host, block-table rows written only where they changed.

A bucket's input buffer holds, end to end, four rows of ``size`` (token ids, positions, state slots, window
starts) and ``size`` block tables of the full width (``max_model_len / block_tokens``: 1,026 entries at
131,072 tokens). Building all of that as a Python list every step cost 55 of a 65 ms step at 256 sequences x
131,072 tokens. Here each bucket keeps two host staging buffers (pinned for a CUDA target) used in turn; a
buffer is written again only once the copy that last read it has run (its event), and each of its table rows
remembers which table it holds (the sequence's ``table_token``: a new one whenever the table is rebuilt or
shrinks) and how many entries it wrote. A step then writes a row's new tail entries only: one block every
``block_tokens`` decode steps of a sequence, or the whole row when a different table moved into it.
"""

from __future__ import annotations

import numpy as np
import torch

from dsinfer.kv.batch import SequenceSpan

HEAD_ROWS = 4  # ids, positions, slots, window starts


class _Stage:
    """One host buffer of a bucket, what its table rows hold, and the copy that last read it."""

    def __init__(self, size: int, width: int, trash: int, pinned: bool) -> None:
        host = torch.empty(size * (HEAD_ROWS + width), dtype=torch.long)
        self.host = host.pin_memory() if pinned else host
        self.array = self.host.numpy()
        self.tables = self.array[HEAD_ROWS * size :].reshape(size, width)
        self.tables.fill(trash)
        self.row_tokens: list[object] = [None] * size
        self.row_lengths = [0] * size
        self.copied: torch.cuda.Event | None = None


class StagedGraphInputs:
    """Host staging for every bucket's inputs; :meth:`write` fills a bucket's device buffer for one step."""

    def __init__(self, sizes: tuple[int, ...], width: int, trash: int, spare_slot: int, pinned: bool) -> None:
        self.width, self.trash, self.spare_slot = width, trash, spare_slot
        self._stages = {size: [_Stage(size, width, trash, pinned) for _ in range(2)] for size in sizes}
        self._next = dict.fromkeys(sizes, 0)

    def write(self, target: torch.Tensor, spans: list[SequenceSpan], size: int) -> None:
        """Stage ``spans`` (then padding rows: position 0 of the spare slot, every block the trash block) for
        bucket ``size`` and copy them into ``target`` asynchronously. Token ids are 0: the step copies its own."""
        stage = self._stages[size][self._next[size]]
        self._next[size] ^= 1
        if stage.copied is not None:
            stage.copied.synchronize()  # the copy that read this buffer two steps ago has run
        count = len(spans)
        head = stage.array[: HEAD_ROWS * size].reshape(HEAD_ROWS, size)
        head[0] = 0
        head[1, :count] = [span.start for span in spans]
        head[2, :count] = [span.slot for span in spans]
        head[3, :count] = [span.window_from for span in spans]
        head[1:, count:] = np.array([[0], [self.spare_slot], [0]])
        for row, span in enumerate(spans):
            self._write_row(stage, row, span)
        for row in range(count, size):
            self._clear_row(stage, row)
        target.copy_(stage.host, non_blocking=True)
        if target.is_cuda:
            stage.copied = torch.cuda.Event()
            stage.copied.record()

    def _write_row(self, stage: _Stage, row: int, span: SequenceSpan) -> None:
        table, token = span.block_table, span.table_token
        written = stage.row_lengths[row]
        if token is None or stage.row_tokens[row] != token or written > len(table):
            stage.tables[row, len(table) :] = self.trash
            written = 0
        if len(table) > written:
            stage.tables[row, written : len(table)] = table[written:]
        stage.row_tokens[row], stage.row_lengths[row] = token, len(table)

    def _clear_row(self, stage: _Stage, row: int) -> None:
        if stage.row_tokens[row] is None and stage.row_lengths[row] == 0:
            return
        stage.tables[row, : stage.row_lengths[row]] = self.trash
        stage.row_tokens[row], stage.row_lengths[row] = None, 0
