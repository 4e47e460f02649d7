"""The ``words`` layout of FP4 index keys for the scores kernel: tiles read as int32 words of 8 packed e2m1 codes.

The ``halves`` layout (:mod:`dsinfer.ops.index_scores_paged.triton`) decodes each code of a byte on its own: about
ten integer operations a code (a compare and select each for codes 0 and 1, the sign, a byte permute to widen) and
a scale byte loaded beside every code, on the loop's critical path. Here a tile of keys is [BLOCK_E, d / 8] int32
and codes ``p`` and ``p + 4`` of a word, 16 bits apart, become one register of two bf16 with one shift and mask
(:func:`_fp4_code_pair`), then two packed bf16 multiplies (the code's value, then its scale: both exact). The
query is read once a chunk with its channels permuted to the codes' order (:func:`fp4_word_channels`), so the
tile meets it in one dot and no register is shuffled. A row's four ue8m0 scale bytes are one int32, which the
loop's pipeline copies ahead like the keys. Compiled for sm_90 at 64 heads x 128 the loop body is about half the
instructions of the halves layout's.
"""

from __future__ import annotations

import torch

from dsinfer.ops.index_scores_paged.reference import PagedIndexInputs
from dsinfer.ops.index_scores_paged.tiles import fill_unseen, split_for_dot
from dsinfer.ops.triton_support import interpreted, tl, triton

CODES_PER_WORD = 8  # packed e2m1 codes in one int32
MIN_DOT_DEPTH = 16  # tl.dot's smallest K

if triton is not None:
    WORD_CODES = tl.constexpr(CODES_PER_WORD)

    @triton.jit
    def _bf16_product(x, y, NATIVE_BF16: tl.constexpr):
        """``x * y`` for bf16 tensors whose product is a bf16 value (powers of two times e2m1 codes): one packed
        bf16 multiply a pair where compiled (``NATIVE_BF16``); in float32 where Triton's interpreter runs (it
        multiplies bf16 bits as integers)."""
        if NATIVE_BF16:
            product = x * y
        else:
            product = (_bf16_widened(x) * _bf16_widened(y)).to(tl.bfloat16)
        return product

    @triton.jit
    def _bf16_widened(x):
        """bf16 ``x`` as float32 through its bits (the interpreter's own cast flushes bf16 subnormals to zero)."""
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp4_word_scales(scales_ptr, scale_row, seen, WORDS: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                         SCALE_WORD: tl.constexpr):  # fmt: skip
        """Each key word's ue8m0 scale ``2**(b - 127)`` as bf16 bits, once a word [BLOCK_E, WORDS] (int32).
        ``SCALE_WORD``: a row's four scale bytes are one int32, read with one 4-byte copy (which the loop's pipeline
        prefetches; single bytes it reads when they are used). Exact for every byte the codec writes (1..254: a
        normal bf16; 0 and 255 it never writes)."""
        block = tl.arange(0, WORDS) * WORD_CODES // SCALE_BLOCK  # the scale block of each word
        if SCALE_WORD:
            packed = tl.load(scales_ptr + scale_row, mask=seen, other=0x7F7F7F7F)
            exponent = (packed[:, None] >> (8 * block)[None, :]) & 0xFF
        else:
            exponent = tl.load(scales_ptr + scale_row[:, None] + block[None, :], mask=seen[:, None],
                               other=127).to(tl.int32)  # fmt: skip
        return exponent << 7

    @triton.jit
    def _fp4_code_pair(words, POSITION: tl.constexpr):
        """Codes ``POSITION`` and ``POSITION + 4`` of every word as the bits of two bf16 ``code * 2**-126`` in the
        low and the high half-word: the two codes sit 16 bits apart, so one shift and mask a pair places both
        magnitudes ``e1 e0 m`` at bits 6..8 of their half-words (bf16's two lowest exponent bits and its top
        mantissa bit; exponent field 0 makes codes 0 and 1, zero and 0.5, subnormals) and both signs at bit 15."""
        if POSITION < 2:
            magnitude = words << (6 - 4 * POSITION)
        else:
            magnitude = words >> (4 * POSITION - 6)
        return (magnitude & 0x01C001C0) | ((words << (12 - 4 * POSITION)) & -0x7FFF8000)  # the mask 0x80008000

    @triton.jit
    def _fp4_word_keys(words, scale_bits, NATIVE_BF16: tl.constexpr):
        """One tile's keys [BLOCK_E, 8 * WORDS] bf16 from its packed words [BLOCK_E, WORDS] and their scales'
        bf16 bits (:func:`_fp4_word_scales`), column ``8w + 2p + i`` holding channel ``8w + p + 4i`` (code ``p +
        4i`` of word ``w``, :func:`fp4_word_channels`): each int32 of code pairs (:func:`_fp4_code_pair`) stays
        one register of two bf16 (``join`` adds a dimension inside each thread), no byte shuffles. One multiply
        by ``2**126`` makes each code's value, one by the scale applies it: both exact (bf16 holds every e2m1
        value times a power of two down to ``2**-133``; the codec's largest scales overflow to infinity as the
        float32 reference does)."""
        pairs = tl.join(tl.join(_fp4_code_pair(words, 0), _fp4_code_pair(words, 2)),
                        tl.join(_fp4_code_pair(words, 1), _fp4_code_pair(words, 3)))  # fmt: skip
        halves = tl.join(pairs.to(tl.int16), (pairs >> 16).to(tl.int16))
        shape: tl.constexpr = [words.shape[0], words.shape[1] * WORD_CODES]
        codes = tl.reshape(halves, shape).to(tl.bfloat16, bitcast=True)
        scales = tl.reshape(tl.broadcast_to(scale_bits.to(tl.int16)[:, :, None], [words.shape[0], words.shape[1],
                            WORD_CODES]), shape).to(tl.bfloat16, bitcast=True)  # fmt: skip
        # 2**126 as bf16 bits (exponent field 253): a bf16 constant of its own would need the builder's bf16
        # scalar, which some Triton interpreters lack
        code_scale = tl.full(shape, 0x7E80, tl.int16).to(tl.bfloat16, bitcast=True)
        return _bf16_product(_bf16_product(codes, code_scale, NATIVE_BF16), scales, NATIVE_BF16)

    @triton.jit
    def fp4_word_channels(HEAD_DIM: tl.constexpr):
        """The channel of each column of :func:`_fp4_word_keys`' tiles: ``8w + 2p + i`` holds ``8w + p + 4i``."""
        column = tl.arange(0, HEAD_DIM)
        return column // WORD_CODES * WORD_CODES + column % WORD_CODES // 2 + 4 * (column % 2)

    @triton.jit
    def _words_scores_kernel(
        q_ptr, weights_ptr, keys_ptr, scales_ptr, tables_ptr, visible_ptr, scores_ptr,
        n_heads, width, chunk, stride_qb, stride_qh, stride_wb, stride_kb, stride_kp, stride_sb_, stride_sp,
        stride_tb, stride_ob, scale,
        PER_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_E: tl.constexpr, SPLIT_Q: tl.constexpr, NUM_STAGES: tl.constexpr, NATIVE_BF16: tl.constexpr,
        SCALE_WORD: tl.constexpr, TILE_IN_BLOCK: tl.constexpr,
    ):  # fmt: skip
        """The split-K scores kernel of :mod:`dsinfer.ops.index_scores_paged.triton` over FP4 keys read as words:
        the same grid, chunks, -inf tail and sums; ``keys_ptr`` int32 words, ``scales_ptr`` int32 (``SCALE_WORD``)
        or ue8m0 bytes; strides in their elements. ``TILE_IN_BLOCK`` (``BLOCK_E`` divides ``PER_BLOCK``, and so
        the chunks, whole tiles, start on a block's tile edge): a tile's slots share one block, read from the
        table once a tile instead of once a slot."""
        seq = tl.program_id(1).to(tl.int64)
        first = tl.program_id(0) * chunk
        last = tl.minimum(first + chunk, width)
        scored_end = tl.minimum(last, tl.load(visible_ptr + seq).to(tl.int32))
        heads = tl.arange(0, BLOCK_H)
        head_ok = heads < n_heads
        out = scores_ptr + seq * stride_ob
        n_scored = tl.cdiv(tl.maximum(scored_end - first, 0), BLOCK_E)
        q = tl.load(q_ptr + seq * stride_qb + heads[None, :] * stride_qh + fp4_word_channels(HEAD_DIM)[:, None],
                    mask=head_ok[None, :], other=0.0)  # fmt: skip
        q_high, q_low = split_for_dot(q, SPLIT_Q, tl.bfloat16)
        weights = tl.load(weights_ptr + seq * stride_wb + heads, mask=head_ok, other=0.0).to(tl.float32)
        table = tables_ptr + seq * stride_tb
        for tile in tl.range(0, n_scored, num_stages=NUM_STAGES):
            tile_first = first + tile * BLOCK_E
            entry = tile_first + tl.arange(0, BLOCK_E)
            seen = entry < scored_end
            if TILE_IN_BLOCK:  # one table entry a tile, its rows consecutive in that block
                block = tl.load(table + tile_first // PER_BLOCK).to(tl.int64)
                in_block = tile_first % PER_BLOCK + tl.arange(0, BLOCK_E)
            else:
                block = tl.load(table + entry // PER_BLOCK, mask=seen, other=0).to(tl.int64)
                in_block = (entry % PER_BLOCK).to(tl.int64)
            key_row, scale_row = block * stride_kb + in_block * stride_kp, block * stride_sb_ + in_block * stride_sp
            words = tl.load(keys_ptr + key_row[:, None] + tl.arange(0, HEAD_DIM // WORD_CODES)[None, :],
                            mask=seen[:, None], other=0)  # fmt: skip
            scale_bits = _fp4_word_scales(scales_ptr, scale_row, seen, HEAD_DIM // WORD_CODES, SCALE_BLOCK,
                                          SCALE_WORD)  # fmt: skip
            keys = _fp4_word_keys(words, scale_bits, NATIVE_BF16)
            products = tl.dot(keys, q_high)
            if SPLIT_Q:
                products = tl.dot(keys, q_low, products)
            summed = tl.sum(tl.maximum(products, 0.0) * weights[None, :], axis=1) * scale
            tl.store(out + entry, tl.where(seen, summed, float("-inf")), mask=entry < last)
        fill_unseen(out, first, n_scored, last, BLOCK_E)


def int32_rows(x: torch.Tensor) -> bool:
    """Whether ``x`` [blocks, per_block, n] views as int32 words: contiguous rows of whole, aligned words."""
    return x.stride(-1) == 1 and x.shape[-1] % 4 == 0 and all(v % 4 == 0 for v in (*x.stride()[:2], x.storage_offset()))


def words_layout_fits(keys: torch.Tensor, key_scales: torch.Tensor, head_dim: int) -> bool:
    """Whether packed FP4 keys can be read as words: rows of whole aligned words, one scale a word, one dot."""
    scale_block = head_dim // key_scales.shape[-1]
    return scale_block % CODES_PER_WORD == 0 and head_dim >= MIN_DOT_DEPTH and int32_rows(keys)


def words_scores_launch(inputs: PagedIndexInputs, weights: torch.Tensor, tables: torch.Tensor, scores: torch.Tensor,
                        chunk: int, launch: dict) -> None:  # fmt: skip
    """Fill ``scores`` [B, W] from FP4 ``inputs`` (:func:`words_layout_fits`) with the words kernel on the grid of
    ``chunk`` slots a program; ``weights`` and ``tables`` contiguous, ``launch``: BLOCK_E, NUM_STAGES, num_warps."""
    q, keys, key_scales = inputs.q, inputs.keys, inputs.key_scales
    batch, n_heads, head_dim = q.shape
    scale_word = key_scales.shape[-1] == 4 and int32_rows(key_scales)
    scales = key_scales.view(torch.int32) if scale_word else key_scales
    words = keys.view(torch.int32)
    tile_in_block = keys.shape[1] % launch["BLOCK_E"] == 0 and chunk % launch["BLOCK_E"] == 0
    _words_scores_kernel[(triton.cdiv(scores.shape[1], chunk), batch)](
        q, weights, words, scales, tables, inputs.visible.contiguous(), scores, n_heads, scores.shape[1], chunk,
        q.stride(0), q.stride(1), weights.stride(0), words.stride(0), words.stride(1), scales.stride(0),
        scales.stride(1), tables.stride(0), scores.stride(0), head_dim**-0.5,
        PER_BLOCK=keys.shape[1], HEAD_DIM=head_dim, SCALE_BLOCK=head_dim // key_scales.shape[-1],
        BLOCK_H=max(16, triton.next_power_of_2(n_heads)), SPLIT_Q=q.dtype != torch.bfloat16,
        NATIVE_BF16=not interpreted(), SCALE_WORD=scale_word, TILE_IN_BLOCK=tile_in_block, **launch,
    )  # fmt: skip
