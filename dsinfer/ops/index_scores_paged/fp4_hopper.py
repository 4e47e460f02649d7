"""FP4 index scores on Hopper's warpgroup MMA with the keys decoded straight into its register operand (Gluon).

The Triton words kernel (:mod:`.fp4_words`) decodes a tile of FP4 keys in registers, but ``tl.dot`` takes its left
operand through shared memory: every tile's 16 KiB of decoded bf16 keys are stored, fenced and read back, and the
loop carries five barriers. Compiled for sm_90 that is 460 instructions a 64-slot tile for each thread, and the loop
waits on latency far more than it issues (0.57 ms at 64 requests x 131,072 entries on an H100, 30% of the key
bytes' roofline). Here the kernel is written in Gluon, Triton's layout-explicit dialect, so each thread decodes
exactly the keys its part of the MMA's register operand holds:

* In the bf16 A fragment of ``wgmma.m64nNk16`` a lane (group ``g``, thread ``t`` of its quad) holds rows ``g`` and
  ``g + 8`` of its warp's 16, columns ``{2t, 2t+1, 2t+8, 2t+9}`` of each 16-wide K step. A query channel's column
  is free (the query is gathered once a chunk in any order), so lane ``t`` takes the four words ``4t .. 4t+3`` of
  each of its two rows (one 16-byte shared-memory read a row, conflict-free) and each word's 8 codes fill its 8
  columns of two K steps: column ``32m + 16s + 8h + 2t + i`` holds code ``s + 2h + 4i`` of word ``4t + m``
  (:func:`operand_channels`). The decoded tile is already the operand: no shuffle, no shared-memory round trip.
* A word's codes ``p`` and ``p + 4`` become one register of two bf16 ``code * 2**-126`` with a shift and a mask
  (as in :mod:`.fp4_words`), and one packed multiply by ``2**(b - 1 - X)`` applies the ue8m0 scale ``2**(b -
  127)`` and the missing ``2**126`` at once; the query is gathered times ``2**X``, ``X`` = 64 (less where the
  query's largest magnitude would leave bf16's range). The factor and the decoded key stay normal bf16 values for
  key block scales from ``2**(X - 125)`` to ``2**(X + 1)`` (``2**-61`` to ``2**65`` at ``X`` = 64), so every
  product is the reference's exactly: the words kernel's two multiplies a pair become one. A block scale outside
  that window is clamped or flushed.
* Key tiles and their scale words stream into a ring of shared-memory slots with ``cp.async`` (``NUM_STAGES``
  tiles in flight, one barrier a tile); the query sits in shared memory in the MMA's layout, once a chunk.

The grid, chunks, sums, -inf tail and scores are the words kernel's. ``paged_scores_launch(fp4_layout=
"words_mma")`` runs it for V4.1's index keys (128 channels, a ue8m0 byte per 32 as one int32 a row, every tile
inside one block) on sm_90 where Gluon is installed (:func:`hopper_words_fits`); elsewhere the words kernel runs.
Triton's interpreter does not run Gluon: the kernel's tests run on CUDA (``tests/ops/test_index_scores_hopper.py``),
and its sm_90 build is checked on the CPU."""

from __future__ import annotations

import torch

from dsinfer.ops.gluon_support import (
    async_copy,
    block_barrier,
    copy_to_shared,
    fence_async_shared,
    gl,
    gluon,
    hopper_gluon_runs,
    warpgroup_mma,
)
from dsinfer.ops.index_scores_paged.fp4_words import int32_rows
from dsinfer.ops.index_scores_paged.reference import PagedIndexInputs

TILE = 64  # slots a tile: the warpgroup MMA's M
HEAD_DIM = 128  # channels: 16 int32 words of 8 codes a row, four a lane
SCALE_BLOCK = 32  # channels a ue8m0 scale byte covers: a row's four bytes are one int32
NUM_WARPS = 4  # one warpgroup
NUM_STAGES = 5  # key tiles in flight a program
MAX_REGISTERS = 96  # a thread's registers: five programs a multiprocessor (104 unbounded: four), nothing spilled
MAX_HEADS = 256  # the MMA's widest N
QUERY_SHIFT = 64  # the most X: the decoded keys stay normal bf16 for block scales down to 2**-61

if gluon is not None:
    TILE_C = gl.constexpr(TILE)
    HEAD_DIM_C = gl.constexpr(HEAD_DIM)
    WARPS_C = gl.constexpr(NUM_WARPS)
    QUERY_SHIFT_C = gl.constexpr(QUERY_SHIFT)

    @gluon.jit
    def _code_pair(words, POSITION: gl.constexpr):
        """Codes ``POSITION`` and ``POSITION + 4`` of every word as two bf16 ``code * 2**-126`` in the low and the
        high half-word (the magnitudes ``e1 e0 m`` at bits 6..8, bf16's two lowest exponent bits and its top
        mantissa bit; codes 0 and 0.5 are subnormals; the signs at bit 15)."""
        if POSITION < 2:
            magnitude = words << (6 - 4 * POSITION)
        else:
            magnitude = words >> (4 * POSITION - 6)
        if POSITION < 3:
            signs = words << (12 - 4 * POSITION)
        else:
            signs = words
        return (magnitude & 0x01C001C0) | (signs & -0x7FFF8000)  # the mask 0x80008000

    @gluon.jit
    def _scaled(pairs, factors):
        """``pairs * factors`` as packed bf16 pairs (int32 bits): one ``mul.rn.bf16x2`` each."""
        return gl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [pairs, factors], dtype=gl.int32,
                                         is_pure=True, pack=1)  # fmt: skip

    @gluon.jit
    def _operand(words, packed_scales, exponent_shift, A_LAYOUT: gl.constexpr):
        """One tile's keys times ``2**-X`` [TILE_C, 128] bf16 in the MMA's register layout, from its words [TILE_C,
        16] (lane ``t`` holding words ``4t .. 4t+3`` of its rows) and each row's four scale bytes as one int32."""
        word_block = gl.arange(0, 16, layout=gl.SliceLayout(0, words.type.layout)) // 4  # the word's scale byte
        exponent = (packed_scales[:, None] >> (8 * word_block)[None, :]) & 0xFF
        field = gl.minimum(gl.maximum(exponent + exponent_shift, 0), 254)  # 2**(b - 1 - X)'s exponent field
        factors = field * 0x00800080  # the same bf16 in both halves
        pairs = gl.join(
            gl.join(_scaled(_code_pair(words, 0), factors), _scaled(_code_pair(words, 1), factors)),
            gl.join(_scaled(_code_pair(words, 2), factors), _scaled(_code_pair(words, 3), factors)),
        )
        halves = gl.join(pairs.to(gl.int16), (pairs >> 16).to(gl.int16))  # [TILE_C, 16, s, h, i]
        columns = gl.permute(gl.reshape(halves, [TILE_C, 4, 4, 2, 2, 2]), [0, 2, 3, 4, 1, 5])  # word = 4t + m
        keys = gl.reshape(columns, [TILE_C, HEAD_DIM_C]).to(gl.bfloat16, bitcast=True)
        return gl.convert_layout(keys, A_LAYOUT, assert_trivial=True)

    @gluon.jit
    def operand_channels(LAYOUT: gl.constexpr):
        """The query channel of each operand column (:func:`_operand`): column ``32m + 16s + 8h + 2t + i`` holds
        channel ``8 (4t + m) + s + 2h + 4i``."""
        column = gl.arange(0, HEAD_DIM_C, layout=LAYOUT)
        lane = (column >> 1) & 3
        return 32 * lane + 8 * (column >> 5) + ((column >> 4) & 1) + 2 * ((column >> 3) & 1) + 4 * (column & 1)

    @gluon.jit
    def _exp2_field(power):
        """``2**power`` (float32) for ``power`` in [-126, 127]."""
        return ((power + 127) << 23).to(gl.float32, bitcast=True)

    @gluon.jit
    def _query_operands(q_ptr, seq, stride_qb, stride_qh, n_heads, BLOCK_H: gl.constexpr, SPLIT_Q: gl.constexpr,
                        high_smem, low_smem):  # fmt: skip
        """The query [128, BLOCK_H] times ``2**X`` in shared memory in the MMA's B layout (and its low bf16 half
        where it is float32); returns ``exponent_shift`` = ``126 - X``, the keys' factor's exponent field less
        their scale byte."""
        LOAD: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, WARPS_C], [0, 1])
        channels = operand_channels(gl.SliceLayout(1, LOAD))
        heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, LOAD))
        q = gl.load(q_ptr + seq * stride_qb + heads[None, :] * stride_qh + channels[:, None],
                    mask=(heads < n_heads)[None, :], other=0.0).to(gl.float32)  # fmt: skip
        top = gl.max(gl.max(gl.abs(q), axis=1), axis=0)
        top_field = (top.to(gl.int32, bitcast=True) >> 23) & 0xFF  # floor(log2(top)) + 127; 0 for zero
        power = gl.minimum(gl.maximum(253 - top_field, 0), QUERY_SHIFT_C)  # X: |q| * 2**X < 2**127, at most 64
        scaled = q * _exp2_field(power)
        high = scaled.to(gl.bfloat16)
        high_smem.store(high)
        if SPLIT_Q:
            low_smem.store((scaled - high.to(gl.float32)).to(gl.bfloat16))
        fence_async_shared()
        return 126 - power

    @gluon.jit
    def _tile_block(table, first, n_scored, tile, PER_BLOCK: gl.constexpr):
        """The block holding tile ``tile``'s slots (0 past the last tile): read a tile ahead of its copy, so the
        copy's address does not wait on the read."""
        return gl.load(table + (first + tile * TILE_C) // PER_BLOCK, mask=tile < n_scored, other=0).to(gl.int64)

    @gluon.jit
    def _issue_tile(words_ring, scales_ring, keys_ptr, scales_ptr, block, first, scored_end, n_scored, tile,
                    word_offsets, copy_rows, scale_rows, stride_kb, stride_kp, stride_sb_, stride_sp,
                    PER_BLOCK: gl.constexpr, NUM_STAGES: gl.constexpr):  # fmt: skip
        """Start copying tile ``tile``'s words and scale words from ``block`` into its ring slot (nothing past the
        last tile)."""
        slot = tile % NUM_STAGES
        tile_first = first + tile * TILE_C
        live = tile < n_scored
        in_block = tile_first % PER_BLOCK
        key_rows = keys_ptr + block * stride_kb + in_block * stride_kp
        copy_to_shared(
            words_ring.index(slot), key_rows + word_offsets, mask=(tile_first + copy_rows < scored_end)[:, None] & live
        )
        scale_row = scales_ptr + block * stride_sb_ + in_block * stride_sp
        copy_to_shared(
            scales_ring.index(slot),
            scale_row + scale_rows * stride_sp,
            mask=(tile_first + scale_rows < scored_end) & live,
        )
        async_copy.commit_group()

    @gluon.jit
    def _hopper_words_kernel(
        q_ptr, weights_ptr, keys_ptr, scales_ptr, tables_ptr, visible_ptr, scores_ptr,
        n_heads, width, chunk, stride_qb, stride_qh, stride_wb, stride_kb, stride_kp, stride_sb_, stride_sp,
        stride_tb, stride_ob, scale,
        PER_BLOCK: gl.constexpr, BLOCK_H: gl.constexpr, SPLIT_Q: gl.constexpr, NUM_STAGES: gl.constexpr,
    ):  # fmt: skip
        """Scores [B, W] of FP4 keys (int32 words, int32 scale rows) on the words kernel's grid (chunks,
        sequences); every chunk a whole number of tiles and every tile inside one block."""
        WORDS: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]],
            lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]],
            block_bases=[],
            shape=[TILE_C, 16],
        )
        COPY_WORDS: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [WARPS_C, 1], [1, 0])
        COPY_SCALES: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS_C], [0])
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[WARPS_C, 1], instr_shape=[16, BLOCK_H, 16]
        )
        A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        Q_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=min(128, 2 * BLOCK_H), element_bitwidth=16)
        RING: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        SCALE_RING: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])

        seq = gl.program_id(1).to(gl.int64)
        first = gl.program_id(0) * chunk
        last = gl.minimum(first + chunk, width)
        scored_end = gl.minimum(last, gl.load(visible_ptr + seq).to(gl.int32))
        n_scored = gl.cdiv(gl.maximum(scored_end - first, 0), TILE_C)
        out = scores_ptr + seq * stride_ob

        q_high = gl.allocate_shared_memory(gl.bfloat16, [HEAD_DIM_C, BLOCK_H], Q_SMEM)
        if SPLIT_Q:
            q_low = gl.allocate_shared_memory(gl.bfloat16, [HEAD_DIM_C, BLOCK_H], Q_SMEM)
        else:
            q_low = q_high
        words_ring = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, TILE_C, 16], RING)
        scales_ring = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, TILE_C], SCALE_RING)
        exponent_shift = _query_operands(q_ptr, seq, stride_qb, stride_qh, n_heads, BLOCK_H, SPLIT_Q, q_high,
                                         q_low)  # fmt: skip
        heads = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, MMA))
        weights = gl.load(weights_ptr + seq * stride_wb + heads, mask=heads < n_heads, other=0.0)
        empty = gl.zeros([TILE_C, BLOCK_H], gl.float32, MMA)

        copy_rows = gl.arange(0, TILE_C, layout=gl.SliceLayout(1, COPY_WORDS))
        word_offsets = copy_rows[:, None] * stride_kp + gl.arange(0, 16, layout=gl.SliceLayout(0, COPY_WORDS))[None, :]
        scale_rows = gl.arange(0, TILE_C, layout=COPY_SCALES)
        table = tables_ptr + seq * stride_tb
        for tile in gl.static_range(NUM_STAGES - 1):
            block = _tile_block(table, first, n_scored, tile, PER_BLOCK)
            _issue_tile(words_ring, scales_ring, keys_ptr, scales_ptr, block, first, scored_end, n_scored, tile,
                        word_offsets, copy_rows, scale_rows, stride_kb, stride_kp, stride_sb_, stride_sp, PER_BLOCK,
                        NUM_STAGES)  # fmt: skip
        next_block = _tile_block(table, first, n_scored, NUM_STAGES - 1, PER_BLOCK)
        for tile in range(n_scored):
            async_copy.wait_group(NUM_STAGES - 2)
            block_barrier()  # every lane's copies of this tile landed; the slot refilled next is read
            slot = tile % NUM_STAGES
            words = words_ring.index(slot).load(WORDS)
            packed_scales = scales_ring.index(slot).load(gl.SliceLayout(1, WORDS))
            block = next_block
            next_block = _tile_block(table, first, n_scored, tile + NUM_STAGES, PER_BLOCK)
            _issue_tile(words_ring, scales_ring, keys_ptr, scales_ptr, block, first, scored_end, n_scored,
                        tile + NUM_STAGES - 1, word_offsets, copy_rows, scale_rows, stride_kb, stride_kp, stride_sb_,
                        stride_sp, PER_BLOCK, NUM_STAGES)  # fmt: skip
            keys = _operand(words, packed_scales, exponent_shift, A_LAYOUT)
            products = warpgroup_mma(keys, q_high, empty, use_acc=False)
            if SPLIT_Q:
                products = warpgroup_mma(keys, q_low, products)
            summed = gl.sum(gl.maximum(products, 0.0) * weights[None, :], axis=1) * scale
            entry = first + tile * TILE_C + gl.arange(0, TILE_C, layout=gl.SliceLayout(1, MMA))
            gl.store(out + entry, gl.where(entry < scored_end, summed, float("-inf")), mask=entry < last)
        async_copy.wait_group(0)
        TAIL: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS_C], [0])
        for start in range(first + n_scored * TILE_C, last, TILE_C):
            entry = start + gl.arange(0, TILE_C, layout=TAIL)
            gl.store(out + entry, gl.full([TILE_C], float("-inf"), gl.float32, TAIL), mask=entry < last)


def hopper_words_fits(inputs: PagedIndexInputs, chunk: int) -> bool:
    """Whether the Gluon kernel takes these FP4 inputs: an sm_90 device with Gluon, 128 channels with one ue8m0
    byte per 32 (a row's four as one aligned int32), every tile inside one block, at most 256 heads."""
    q, keys, key_scales = inputs.q, inputs.keys, inputs.key_scales
    if not hopper_gluon_runs(q.device):
        return False
    shapes = q.shape[-1] == HEAD_DIM and key_scales.shape[-1] == HEAD_DIM // SCALE_BLOCK and q.shape[1] <= MAX_HEADS
    blocks = keys.shape[1] % TILE == 0 and chunk % TILE == 0
    return (
        shapes and blocks and q.dtype in (torch.bfloat16, torch.float32) and int32_rows(keys) and int32_rows(key_scales)
    )


def hopper_words_launch(
    inputs: PagedIndexInputs,
    weights: torch.Tensor,
    tables: torch.Tensor,
    scores: torch.Tensor,
    chunk: int,
    num_stages: int = NUM_STAGES,
    max_registers: int = MAX_REGISTERS,
) -> None:
    """Fill ``scores`` [B, W] from FP4 ``inputs`` (:func:`hopper_words_fits`) on the grid of ``chunk`` slots a
    program; ``weights`` float32 and ``tables`` contiguous; ``max_registers`` 0: the compiler's own count."""
    q = inputs.q
    batch, n_heads, _ = q.shape
    words, scales = inputs.keys.view(torch.int32), inputs.key_scales.view(torch.int32)
    block_h = max(16, 1 << (n_heads - 1).bit_length())
    _hopper_words_kernel[(-(-scores.shape[1] // chunk), batch)](
        q, weights, words, scales, tables, inputs.visible.contiguous(), scores, n_heads, scores.shape[1], chunk,
        q.stride(0), q.stride(1), weights.stride(0), words.stride(0), words.stride(1), scales.stride(0),
        scales.stride(1), tables.stride(0), scores.stride(0), HEAD_DIM**-0.5,
        PER_BLOCK=inputs.keys.shape[1], BLOCK_H=block_h, SPLIT_Q=q.dtype != torch.bfloat16, NUM_STAGES=num_stages,
        num_warps=NUM_WARPS, **({"maxnreg": max_registers} if max_registers else {}),
    )  # fmt: skip
