"""V4.1's selections over index scores in Triton: one program per query row, the row held in registers.

The reference chooses through the packed-key top-k (about fifteen kernels: the score's ordered bits, a shift,
an or, ``torch.topk`` over int64 keys), then a gather, a compare, a ``where`` and an int64 sort to put the choice
in entry order; the candidate blocks add an amax, a scatter and a repeat. On a GPU each of those is a launch, and
the int64 ``topk`` / ``sort`` are among the costliest kernels of a decode step.

Here a program loads its row's scores (padded to a power of two), maps each to the same order-preserving
unsigned key as the reference's packed key (negatives' magnitude bits flipped, ``-0`` and ``+0`` one key), and
finds the k-th largest key bit by bit from the top (32 counts over the row): the keys above it are chosen, and
among the keys equal to it the lowest entries, by a running count (the reference's tie rule, exactly). The
choice is written in entry order by a cumulative sum: the same entries in the same order as the reference, bit
for bit. ``index_topk_decode`` writes the chosen finite entries then -1; ``candidate_block_mask`` takes each
block's best score first (the newest visible block forced in) and writes the kept blocks' entries as a mask.

Rows wider than ``MAX_WIDTH`` entries go to the reference (their registers would spill).
"""

from __future__ import annotations

import torch

from dsinfer.ops.index_select.reference import candidate_block_mask_reference, index_topk_decode_reference
from dsinfer.ops.registry import register
from dsinfer.ops.sparse_attention.triton import sparse_attention_triton_available

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

MAX_WIDTH = 16384  # scores a program holds: 64 a thread at 8 warps


if triton is not None:

    @triton.jit
    def _ordered_keys(scores):
        """Unsigned keys (uint32) ordered as the float32 ``scores``; ``-0`` and ``+0`` share one."""
        bits = scores.to(tl.int32, bitcast=True)
        flipped = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        flipped = tl.where(scores == 0, 0, flipped)
        return (flipped ^ -2147483648).to(tl.uint32, bitcast=True)

    @triton.jit
    def _top(keys, valid, k):
        """Which of the ``valid`` elements are the ``k`` largest ``keys`` (ties: lowest position first)."""
        threshold = tl.zeros([], dtype=tl.uint32)
        for bit in tl.static_range(31, -1, -1):
            candidate = threshold | (tl.full([], 1, tl.uint32) << bit)
            count = tl.sum((valid & (keys >= candidate)).to(tl.int32), axis=0)
            threshold = tl.where(count >= k, candidate, threshold)
        greater = valid & (keys > threshold)
        tied = valid & (keys == threshold)
        room = k - tl.sum(greater.to(tl.int32), axis=0)
        return greater | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= room))

    @triton.jit
    def _topk_kernel(scores_ptr, allowed_ptr, out_ptr, width, k, stride_s, stride_a, stride_o,
                     HAS_ALLOWED: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        entry = tl.arange(0, BLOCK_W)
        inside = entry < width
        scores = tl.load(scores_ptr + row * stride_s + entry, mask=inside, other=float("-inf")).to(tl.float32)
        if HAS_ALLOWED:
            allowed = tl.load(allowed_ptr + row * stride_a + entry, mask=inside, other=0)
            scores = tl.where(allowed != 0, scores, float("-inf"))
        chosen = _top(_ordered_keys(scores), inside, k) & (scores > float("-inf"))
        slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        n_chosen = tl.sum(chosen.to(tl.int32), axis=0)
        out = out_ptr + row * stride_o
        tl.store(out + slot, entry.to(tl.int64), mask=chosen)
        tl.store(out + entry, tl.full([BLOCK_W], -1, tl.int64), mask=(entry >= n_chosen) & (entry < k))

    @triton.jit
    def _candidate_kernel(scores_ptr, counts_ptr, out_ptr, width, num_blocks, topk, stride_s, stride_o,
                          BLOCK_SIZE: tl.constexpr, BLOCK_B: tl.constexpr):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        block = tl.arange(0, BLOCK_B)
        entry = block[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]
        inside = entry < width
        scores = tl.load(scores_ptr + row * stride_s + entry, mask=inside, other=float("-inf")).to(tl.float32)
        best = tl.max(scores, axis=1)
        count = tl.load(counts_ptr + row)
        newest = tl.where(count > 0, (count - 1) // BLOCK_SIZE, -1)  # C division truncates: no negative floor
        best = tl.where(block == newest, float("inf"), best)
        kept = _top(_ordered_keys(best), block < num_blocks, topk) & (best > float("-inf"))
        mask = tl.broadcast_to(kept[:, None], [BLOCK_B, BLOCK_SIZE])
        tl.store(out_ptr + row * stride_o + entry, mask.to(tl.uint8), mask=inside)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8


@register("index_topk_decode", "triton", devices=("cuda",), available=sparse_attention_triton_available, priority=10)
def index_topk_decode_triton(scores: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract and result as the reference; rows wider than ``MAX_WIDTH`` go to it."""
    if scores.dim() != 2 or scores.shape[1] > MAX_WIDTH or scores.dtype != torch.float32:
        return index_topk_decode_reference(scores, k, allowed)
    rows, width = scores.shape
    k = min(k, width)
    out = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    if rows == 0 or k == 0:
        return out
    scores = scores.contiguous()
    allowed_arg = scores if allowed is None else allowed.contiguous().view(torch.uint8)
    block = triton.next_power_of_2(width)
    _topk_kernel[(rows,)](scores, allowed_arg, out, width, k, scores.stride(0), allowed_arg.stride(0), out.stride(0),
                          HAS_ALLOWED=allowed is not None, BLOCK_W=block, num_warps=_warps(block))  # fmt: skip
    return out


@register("candidate_block_mask", "triton", devices=("cuda",), available=sparse_attention_triton_available,
          priority=10)  # fmt: skip
def candidate_block_mask_triton(
    scores: torch.Tensor, visible_counts: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """Same contract and result as the reference; rows wider than ``MAX_WIDTH`` go to it."""
    rows, width = scores.shape if scores.dim() == 2 else (0, 0)
    num_blocks = -(-width // block_size) if block_size > 0 else 0
    block_b = triton.next_power_of_2(max(num_blocks, 1))
    if (scores.dim() != 2 or scores.dtype != torch.float32 or block_size <= 0 or block_size & (block_size - 1)
            or block_b * block_size > MAX_WIDTH):  # fmt: skip
        return candidate_block_mask_reference(scores, visible_counts, topk_blocks, block_size)
    out = torch.empty(rows, width, dtype=torch.uint8, device=scores.device)
    if rows and width:
        scores = scores.contiguous()
        _candidate_kernel[(rows,)](scores, visible_counts.contiguous(), out, width, num_blocks,
                                   min(topk_blocks, num_blocks), scores.stride(0), out.stride(0),
                                   BLOCK_SIZE=block_size, BLOCK_B=block_b,
                                   num_warps=_warps(block_b * block_size))  # fmt: skip
    return out.view(torch.bool)
