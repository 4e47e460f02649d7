"""V4.1's selections over index scores in Triton: one program per query row, the row held in registers.

The reference chooses through the packed-key top-k (about fifteen kernels: the score's ordered bits, a shift,
an or, ``torch.topk`` over int64 keys), then a gather, a compare, a ``where`` and an int64 sort to put the choice
in entry order; the candidate blocks add an amax, a scatter and a repeat. On a GPU each of those is a launch, and
the int64 ``topk`` / ``sort`` are among the costliest kernels of a decode step.

Here a program loads its row's scores (padded to a power of two), maps each to the same order-preserving
unsigned key as the reference's packed key (negatives' magnitude bits flipped, ``-0`` and ``+0`` one key), and
finds the k-th largest key from the top, one bit a count over the row (:func:`_top`; a row of at most k finite
keys at once): the keys above it are chosen, and among the keys equal to it the lowest entries, by a
running count (the reference's tie rule, exactly). The choice is written in entry order by a cumulative sum: the
same entries in the same order as the reference, bit for bit. ``index_topk_decode`` writes the chosen finite
entries then -1; ``candidate_block_mask`` takes each block's best score first (the newest visible block forced
in) and writes the kept blocks' entries as a mask.

A row wider than ``CHUNK`` (a long context's 32,800 slots) is cut into equal chunks, one program each, that keep
their own best ``k`` as candidates (entry and score, ascending); one more program per row chooses among those.
Every entry of the row's top k is among its chunk's top k (fewer than k entries of the chunk beat it), and ties
stay lowest-entry-first because the candidates keep entry order: the same answer, bit for bit. Rows whose
candidates would not fit one program (more than ``MAX_WIDTH``) go to the reference.
"""

from __future__ import annotations

import torch

from dsinfer.ops.index_select.reference import (
    candidate_block_mask_reference,
    candidate_block_scores,
    index_topk_decode_reference,
)
from dsinfer.ops.registry import register
from dsinfer.ops.sparse_attention.triton import sparse_attention_triton_available

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

MAX_WIDTH = 16384  # scores a program holds: 64 a thread at 8 warps
CHUNK = 4096  # a wider row: chunks of at most this many, their candidates merged by one more program
REGISTER_CAP = 72  # the selections' registers a thread (``maxnreg``; 0: the compiler's): three 8-warp chunk
# programs a multiprocessor on sm_90 without a spill (109 unbounded: two); 1.66x faster on an H100 at 8,192 x 32,768
# (benchmarks/index_topk.py)
CAPPED_WARPS = 8  # the cap applies to programs of at most this many warps (16 fit one a multiprocessor either way)


if triton is not None:

    @triton.jit
    def _ordered_keys(scores):
        """Unsigned keys (uint32) ordered as the float32 ``scores``; ``-0`` and ``+0`` share one."""
        bits = scores.to(tl.int32, bitcast=True)
        flipped = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        flipped = tl.where(scores == 0, 0, flipped)
        return (flipped ^ -2147483648).to(tl.uint32, bitcast=True)

    @triton.jit
    def _top(keys, k):
        """Which of ``keys`` are the ``k`` largest (ties: lowest position first); a key of 0 (below every score's,
        -inf's included) marks a place outside the row: never counted, and never chosen while ``k`` others are.

        The k-th largest key is found from the top, one bit a count: the largest extension of the threshold so far
        with at least ``k`` keys at or above it is kept. Once the kept extension has exactly ``k`` keys at or above
        it, those are the choice whatever the lower bits say, so the remaining counts are skipped (random scores
        settle after about log2(width) + 4 bits instead of 32); a row of at most ``k`` finite keys chooses them all
        with no count."""
        few = tl.sum((keys > 0x7FFFFF).to(tl.int32), axis=0) <= k
        threshold = tl.where(few, 0x800000, 0).to(tl.uint32)  # the lowest finite key: every finite one chosen
        settled = few.to(tl.int32)
        for step in tl.static_range(32):
            if settled == 0:
                candidate = threshold | (tl.full([], 1, tl.uint32) << (31 - step))
                count = tl.sum((keys >= candidate).to(tl.int32), axis=0)
                threshold = tl.where(count >= k, candidate, threshold)
                settled = (count == k).to(tl.int32)
        greater = keys > threshold
        tied = keys == threshold
        room = k - tl.sum(greater.to(tl.int32), axis=0)
        return greater | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= room))

    @triton.jit
    def _finite(keys):
        """Which ordered keys stand for finite scores (-inf's key is 0x7FFFFF; places outside the row are 0)."""
        return keys > 0x7FFFFF

    @triton.jit
    def _topk_kernel(scores_ptr, allowed_ptr, out_ptr, kept_ptr, width, chunk, k, stride_s, stride_a, stride_o,
                     HAS_ALLOWED: tl.constexpr, KEEP_KEYS: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
        """Program (c, row): the best ``k`` finite entries of chunk c of the row, ascending, then -1, into the
        row's ``k`` slots of chunk c (one chunk: the answer; several: candidates, their keys into ``kept``)."""
        row = tl.program_id(1).to(tl.int64)
        position = tl.arange(0, BLOCK_W)
        entry = tl.program_id(0) * chunk + position
        inside = (position < chunk) & (entry < width)
        scores = tl.load(scores_ptr + row * stride_s + entry, mask=inside, other=float("-inf")).to(tl.float32)
        if HAS_ALLOWED:
            allowed = tl.load(allowed_ptr + row * stride_a + entry, mask=inside, other=0)
            scores = tl.where(allowed != 0, scores, float("-inf"))
        keys = tl.where(inside, _ordered_keys(scores), 0)
        chosen = _top(keys, k) & _finite(keys)
        slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        padding = (position >= tl.sum(chosen.to(tl.int32), axis=0)) & (position < k)
        first_slot = row * stride_o + tl.program_id(0) * k
        tl.store(out_ptr + first_slot + slot, entry, mask=chosen)
        tl.store(out_ptr + first_slot + position, tl.full([BLOCK_W], -1, tl.int32), mask=padding)
        if KEEP_KEYS:
            tl.store(kept_ptr + first_slot + slot, keys, mask=chosen)
            tl.store(kept_ptr + first_slot + position, tl.zeros([BLOCK_W], tl.uint32), mask=padding)

    @triton.jit
    def _merge_kernel(kept_ptr, entries_ptr, out_ptr, n_candidates, k, stride_c, stride_o, BLOCK_C: tl.constexpr):
        """One program a row: the best ``k`` of the chunks' candidates (ascending entries, so the lowest position
        among ties is the lowest entry), ascending, then -1."""
        row = tl.program_id(0).to(tl.int64)
        position = tl.arange(0, BLOCK_C)
        inside = position < n_candidates
        keys = tl.load(kept_ptr + row * stride_c + position, mask=inside, other=0)
        chosen = _top(keys, k) & _finite(keys)
        slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        entries = tl.load(entries_ptr + row * stride_c + position, mask=chosen, other=-1)
        out = out_ptr + row * stride_o
        tl.store(out + slot, entries, mask=chosen)
        padding = (position >= tl.sum(chosen.to(tl.int32), axis=0)) & (position < k)
        tl.store(out + position, tl.full([BLOCK_C], -1, tl.int32), mask=padding)

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
        kept = _top(tl.where(block < num_blocks, _ordered_keys(best), 0), topk) & (best > float("-inf"))
        mask = tl.broadcast_to(kept[:, None], [BLOCK_B, BLOCK_SIZE])
        tl.store(out_ptr + row * stride_o + entry, mask.to(tl.uint8), mask=inside)


def _warps(block: int) -> int:
    """Warps for a row of ``block`` keys: about 16 a thread (sm_90 builds without register spills to 8,192)."""
    return 4 if block <= 1024 else min(32, block // 512)


def _register_cap(num_warps: int) -> dict:
    """The launch option capping a thread's registers (NVIDIA only) for a program of ``num_warps`` warps."""
    if not REGISTER_CAP or num_warps > CAPPED_WARPS or torch.version.hip is not None:
        return {}
    return {"maxnreg": REGISTER_CAP}


def chunking(width: int, k: int) -> tuple[int, int] | None:
    """(chunk, chunks) for a row of ``width`` scores: one chunk up to ``CHUNK``, else the fewest equal chunks of at
    most ``CHUNK`` (or twice, or ``MAX_WIDTH``, when the chunks' ``k`` candidates each would not fit one program);
    None: even those do not fit (the reference chooses)."""
    for most in (CHUNK, 2 * CHUNK, MAX_WIDTH):
        chunks = -(-width // most)
        if chunks == 1 or chunks * min(k, -(-width // chunks)) <= MAX_WIDTH:
            return -(-width // chunks), chunks
    return None


@register("index_topk_decode", "triton", devices=("cuda",), available=sparse_attention_triton_available, priority=10)
def index_topk_decode_triton(scores: torch.Tensor, k: int, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract and result as the reference; rows whose candidates do not fit (:func:`chunking`) go to it."""
    rows, width = scores.shape if scores.dim() == 2 else (0, 0)
    split = chunking(width, k) if width else (0, 1)
    if scores.dim() != 2 or split is None or scores.dtype != torch.float32:
        return index_topk_decode_reference(scores, k, allowed)
    k = min(k, width)
    out = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    if rows == 0 or k == 0:
        return out
    chunk, chunks = split
    scores = scores.contiguous()
    allowed_arg = scores if allowed is None else allowed.contiguous().view(torch.uint8)
    block = triton.next_power_of_2(chunk)
    per_chunk = min(k, chunk)
    candidates = chunks * per_chunk
    entries = out if chunks == 1 else torch.empty(rows, candidates, dtype=torch.int32, device=scores.device)
    kept = scores if chunks == 1 else torch.empty(rows, candidates, dtype=torch.uint32, device=scores.device)
    warps = _warps(block)
    _topk_kernel[(chunks, rows)](scores, allowed_arg, entries, kept, width, chunk, per_chunk, scores.stride(0),
                                 allowed_arg.stride(0), entries.stride(0), HAS_ALLOWED=allowed is not None,
                                 KEEP_KEYS=chunks > 1, BLOCK_W=block, num_warps=warps,
                                 **_register_cap(warps))  # fmt: skip
    if chunks > 1:
        block = triton.next_power_of_2(candidates)
        warps = _warps(block)
        _merge_kernel[(rows,)](kept, entries, out, candidates, k, kept.stride(0), out.stride(0), BLOCK_C=block,
                               num_warps=warps, **_register_cap(warps))  # fmt: skip
    return out


@register("candidate_block_mask", "triton", devices=("cuda",), available=sparse_attention_triton_available,
          priority=10)  # fmt: skip
def candidate_block_mask_triton(
    scores: torch.Tensor, visible_counts: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """Same contract and result as the reference; rows wider than ``MAX_WIDTH`` choose their blocks with the chunked
    selection (:func:`_wide_candidate_mask`)."""
    rows, width = scores.shape if scores.dim() == 2 else (0, 0)
    num_blocks = -(-width // block_size) if block_size > 0 else 0
    block_b = triton.next_power_of_2(max(num_blocks, 1))
    if scores.dim() != 2 or scores.dtype != torch.float32 or block_size <= 0 or block_size & (block_size - 1):
        return candidate_block_mask_reference(scores, visible_counts, topk_blocks, block_size)
    if block_b * block_size > MAX_WIDTH:
        return _wide_candidate_mask(scores, visible_counts, topk_blocks, block_size)
    out = torch.empty(rows, width, dtype=torch.uint8, device=scores.device)
    if rows and width:
        scores = scores.contiguous()
        _candidate_kernel[(rows,)](scores, visible_counts.contiguous(), out, width, num_blocks,
                                   min(topk_blocks, num_blocks), scores.stride(0), out.stride(0),
                                   BLOCK_SIZE=block_size, BLOCK_B=block_b,
                                   num_warps=_warps(block_b * block_size))  # fmt: skip
    return out.view(torch.bool)


def _wide_candidate_mask(
    scores: torch.Tensor, visible_counts: torch.Tensor, topk_blocks: int, block_size: int
) -> torch.Tensor:
    """``candidate_block_mask`` of rows wider than one program holds (a 131,072-entry ratio-1 source): the
    reference's block scores (:func:`candidate_block_scores`), the best ``topk_blocks`` with a finite score chosen by
    :func:`index_topk_decode_triton` (chunks merged; ties to the lowest block, as the reference's), their entries
    marked."""
    rows, width = scores.shape
    block_scores = candidate_block_scores(scores, visible_counts, block_size)
    num_blocks = block_scores.shape[-1]
    chosen = index_topk_decode_triton(block_scores, topk_blocks)  # ascending, then -1
    keep = torch.zeros(rows, num_blocks + 1, dtype=torch.bool, device=scores.device)  # column num_blocks: the -1's
    keep.scatter_(1, torch.where(chosen < 0, num_blocks, chosen), True)
    return keep[:, :num_blocks].repeat_interleave(block_size, dim=-1)[:, :width]
