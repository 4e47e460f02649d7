"""``greedy_argmax`` in two Triton passes: the row is split into chunks read in parallel, then each row's chunk
winners are reduced.

``torch.argmax`` reduces a row of the vocabulary (129,280 scores) in one block of threads: at a decode step of
one request that kernel took 27 us on the H200 beside a 1.16 ms model step, for 253 KiB of bf16. Here the first
pass gives each of ``ceil(V / CHUNK)`` programs a chunk of one row, and writes the chunk's winner (its value and
column); the second reduces one row's winners in one program. The chunks are in column order, so taking the
first of equal winners keeps torch's rule, the lowest column; a NaN beats every number (torch's rule too), so
a row with NaN gives its first NaN. The scores are compared in float32, which holds every bf16 and fp16 value
exactly: the raw logits give the same token as their float32 copy.
"""

from __future__ import annotations

import torch

from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

CHUNK = 2048  # scores a first-pass program reads: 64 programs a row at V = 129,280
MAX_CHUNKS = 1024  # the second pass holds a row's winners in one program: rows up to 2M scores


if triton is not None:

    @triton.jit
    def _first_winner(values, columns, valid):
        """(value, column) of the first maximum of ``values`` where ``valid`` (NaN beats every number), or of
        the first valid entry if every valid one is -inf; ``columns`` are increasing."""
        nan = valid & (values != values)
        first_nan = tl.min(tl.where(nan, columns, 2147483647), axis=0)
        best = tl.max(tl.where(valid & ~nan, values, float("-inf")), axis=0)
        first_best = tl.min(tl.where(valid & ~nan & (values == best), columns, 2147483647), axis=0)
        has_nan = first_nan < 2147483647
        column = tl.where(has_nan, first_nan, first_best)
        value = tl.where(has_nan, float("nan"), best)
        return value, column

    @triton.jit
    def _chunk_kernel(scores_ptr, values_ptr, columns_ptr, vocab, stride_row, chunks, CHUNK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        column = chunk * CHUNK + tl.arange(0, CHUNK)
        valid = column < vocab
        scores = tl.load(scores_ptr + row * stride_row + column, mask=valid, other=float("-inf")).to(tl.float32)
        value, winner = _first_winner(scores, column, valid)
        tl.store(values_ptr + row * chunks + chunk, value)
        tl.store(columns_ptr + row * chunks + chunk, winner)

    @triton.jit
    def _row_kernel(values_ptr, columns_ptr, out_ptr, chunks, CHUNKS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.arange(0, CHUNKS)
        valid = chunk < chunks
        values = tl.load(values_ptr + row * chunks + chunk, mask=valid, other=float("-inf"))
        columns = tl.load(columns_ptr + row * chunks + chunk, mask=valid, other=2147483647)
        _, winner = _first_winner(values, chunk, valid)
        column = tl.min(tl.where(chunk == winner, columns, 2147483647), axis=0)
        tl.store(out_ptr + row, column.to(tl.int64))


@register("greedy_argmax", "triton", devices=("cuda",), available=triton_available, priority=10)
def greedy_argmax_triton(scores: torch.Tensor) -> torch.Tensor:
    """Same contract as ``greedy_argmax_reference``; inputs the kernels do not take go to the reference."""
    chunks = triton.cdiv(scores.shape[-1], CHUNK) if scores.dim() == 2 else 0
    if scores.dim() != 2 or scores.stride(-1) != 1 or not 0 < chunks <= MAX_CHUNKS or not scores.is_floating_point():
        from dsinfer.ops.argmax.reference import greedy_argmax_reference

        return greedy_argmax_reference(scores)
    rows, vocab = scores.shape
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows:
        values = torch.empty(rows, chunks, dtype=torch.float32, device=scores.device)
        columns = torch.empty(rows, chunks, dtype=torch.int32, device=scores.device)
        stride = scores.stride(0)
        _chunk_kernel[(rows, chunks)](scores, values, columns, vocab, stride, chunks, CHUNK=CHUNK, num_warps=4)
        _row_kernel[(rows,)](values, columns, out, chunks, CHUNKS=triton.next_power_of_2(chunks), num_warps=4)
    return out
