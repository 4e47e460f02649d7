"""``copy_expert_rows`` as one Triton kernel that reads the host store in place.

Why a kernel and not ``cudaMemcpyAsync``: which experts a step misses is known only on the device (the router's
top-k), and a copy a CUDA graph records has a fixed source, destination and size. A memcpy would need the miss
list on the host (a synchronisation per layer, no graph). A kernel takes the list as a device tensor: program
``(i, chunk)`` reads entry ``i``, returns at once when it copies nothing, and otherwise moves one chunk of the row.
The host store is pinned memory, which under unified virtual addressing has one address on the host and the GPU
(the source tensor is a CUDA alias of it, :func:`dsinfer.offload.host_store.device_alias`), so the loads travel
over PCIe as the kernel issues them; many programs in flight with 8-byte words keep the link busy. The graph
records the launch with its fixed grid (one row per offloaded expert of the layer); only the rows the step needs
move.
"""

from __future__ import annotations

import torch

from dsinfer.ops.expert_fetch.reference import check_rows
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

CHUNK_BYTES = 256 * 1024  # bytes of one row a program copies: ~50 programs per FP4 expert gate-up part
BLOCK_BYTES = 16 * 1024  # bytes one loop step loads and stores

if triton is not None:

    @triton.jit
    def _copy_rows_kernel(source_ptr, target_ptr, source_rows_ptr, target_rows_ptr, row_words,
                          CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        """Chunk ``program_id(1)`` of entry ``program_id(0)``'s row, unless the entry copies nothing."""
        entry = tl.program_id(0)
        source_row = tl.load(source_rows_ptr + entry)
        if source_row >= 0:
            target_row = tl.load(target_rows_ptr + entry)
            source_base = source_ptr + source_row.to(tl.int64) * row_words
            target_base = target_ptr + target_row.to(tl.int64) * row_words
            start = tl.program_id(1).to(tl.int64) * CHUNK
            for offset in range(0, CHUNK, BLOCK):
                words = start + offset + tl.arange(0, BLOCK)
                inside = words < row_words
                values = tl.load(source_base + words, mask=inside)
                tl.store(target_base + words, values, mask=inside)


@register("copy_expert_rows", "triton", devices=("cuda",), available=triton_available)
def copy_expert_rows_triton(
    source: torch.Tensor,
    target: torch.Tensor,
    source_rows: torch.Tensor,
    target_rows: torch.Tensor,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """The reference's copy in one launch with a fixed grid (``source`` may alias pinned host memory;
    ``chunk_bytes``: bytes of a row per program, smaller in tests so rows span several chunks)."""
    if triton is None:
        raise RuntimeError("the triton copy_expert_rows backend needs Triton installed")
    check_rows(source, target, source_rows, target_rows)
    entries, row_words = source_rows.numel(), target.shape[1]
    if entries == 0 or row_words == 0 or source.shape[0] == 0:
        return
    word = target.element_size()
    block = min(BLOCK_BYTES // word, triton.next_power_of_2(row_words))
    chunk = max(block, min(chunk_bytes // word, triton.cdiv(row_words, block) * block))
    grid = (entries, triton.cdiv(row_words, chunk))
    _copy_rows_kernel[grid](source, target, source_rows, target_rows, row_words, CHUNK=chunk, BLOCK=block)
