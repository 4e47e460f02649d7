"""``rope_round_store`` on CUDA: the row chain (:func:`~dsinfer.ops.norm_rope.row_chain_triton.chain_rows`) and the
cache write (:mod:`dsinfer.ops.cache_codec.triton`'s encoding and scatter) in one kernel.

A V4.1 decode step stored each rounded row in a second launch that read it back, re-encoded it and scattered the
codes: eight such launches a step on the 4-layer slice (the window K=V of every layer, the entries and index keys
of the two KV sources), each about 3 us of a step whose cost is its launches. Here the program that computes a
row encodes it in registers and writes the codes and scales (or, in model-dtype storage, the row itself) where
``cache_store`` would.

Bytes: the chain's result is cast to the rows' dtype and read back as float32, as ``cache_store`` reads the rows
``rope_and_round`` stores, then encoded by the same helpers as the ``cache_encode`` kernel: the pool holds the
bytes of the two ops one after the other, bit for bit. Inputs the kernel does not take (rows that are not 2-D,
a coded width that is no power of two, a pool that is not contiguous) run the two ops' backends in turn.
"""

from __future__ import annotations

import torch

from dsinfer import envs
from dsinfer.ops.cache_codec.triton import OUT_DTYPES, cache_store_triton, encoding_kind
from dsinfer.ops.norm_rope.row_chain_triton import launch_chain
from dsinfer.ops.registry import register
from dsinfer.ops.rope_round.reference import RopeRoundStoreInputs
from dsinfer.ops.rope_round.triton import chain_rows_of, kernel_takes, rope_and_round_triton
from dsinfer.ops.triton_support import tl, triton, triton_available

if triton is not None:
    from dsinfer.ops.cache_codec.triton import encode_fp4_blocks, encode_fp8_blocks
    from dsinfer.ops.norm_rope.row_chain_triton import chain_rows

PLAIN = -1  # ENCODE for model-dtype storage: the row itself, cast to the pool's dtype
ROWS_PER_PROGRAM = 1  # a decode step's few rows; with four, the FP4 / e4m3 scale search spills on sm_90
WIDE_ROW_WARPS = 8
"""Warps of a program that stores one row of 512 channels or more. A decode step stores a handful of rows, one
program each, so a program's time is the length of its dependent chain: at eight warps each thread holds two
channels, and the sm_90 code of the FP4 / e4m3 entries' store is 1536 instructions a thread against 2728 at four
(the window's FP8 store: 584 against 752). On the H200 the V4.1 slice's eight stores a decode step took 23.8 us
against 33.0 with coded storage and 13.9 against 16.1 in model dtype (``DSINFER_STORE_WARPS=4|8 python3
benchmarks/v41_decode_checks.py --experts 384 --batches 1 --context 256 --repeats 30 --profile 40``,
docs/perf.md, pass 12). ``DSINFER_STORE_WARPS`` overrides it (a power of two, 1 to 16)."""


def store_warps(width: int) -> int | None:
    """Warps a store program takes for rows of ``width`` channels (None: the norm kernels' choice)."""
    setting = envs.STORE_WARPS.get()
    if setting is not None:
        return setting
    return WIDE_ROW_WARPS if width >= 512 else None


if triton is not None:

    @triton.jit
    def _chain_store_kernel(
        src,
        weight,
        cos_ptr,
        sin_ptr,
        data_ptr,
        scales_ptr,
        first_ptr,
        second_ptr,
        second_size,
        modulus,
        rows,
        width,
        inner,
        stride_outer,
        stride_inner,
        stride_cn,
        stride_cc,
        stride_sn,
        stride_sc,
        eps,
        NOPE: tl.constexpr,
        NORM: tl.constexpr,
        KIND: tl.constexpr,
        QUANT_BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        ENCODE: tl.constexpr,  # PLAIN, else the cache_encode kernel's KIND (0 FP8, 1 FP4 / e4m3, 2 FP4 / ue8m0)
        CODE_BLOCK: tl.constexpr,  # channels per scale (coded storage)
        HAS_MODULUS: tl.constexpr,
    ):
        """Row ``r`` through the chain, then to pool row ``(first[r], second[r] % modulus)`` of ``data`` [N0,
        second_size, width or code bytes] (and its scale bytes to ``scales`` [N0, second_size, width /
        CODE_BLOCK])."""
        out, row, mask = chain_rows(
            src, weight, cos_ptr, sin_ptr, rows, width, inner, stride_outer, stride_inner, stride_cn, stride_cc,
            stride_sn, stride_sc, eps, NOPE, NORM, KIND, QUANT_BLOCK, ROWS, BLOCK,
        )  # fmt: skip
        row_ok = row < rows
        first = tl.load(first_ptr + row, mask=row_ok, other=0).to(tl.int64)
        second = tl.load(second_ptr + row, mask=row_ok, other=0).to(tl.int64)
        if HAS_MODULUS:
            second = second % modulus
        pool_row = first * second_size + second
        values = out.to(src.dtype.element_ty).to(tl.float32)  # the rows as rope_and_round stores them
        if ENCODE < 0:  # PLAIN
            offsets = pool_row[:, None] * width + tl.arange(0, BLOCK)[None, :]
            tl.store(data_ptr + offsets, values.to(data_ptr.dtype.element_ty), mask=mask)
        else:  # whole power-of-two rows (BLOCK == width): every block is live
            BLOCKS: tl.constexpr = BLOCK // CODE_BLOCK
            scale_offsets = pool_row[:, None] * BLOCKS + tl.arange(0, BLOCKS)[None, :]
            if ENCODE == 0:
                codes, scale_bytes = encode_fp8_blocks(tl.reshape(values, [ROWS * BLOCKS, CODE_BLOCK]))
                offsets = pool_row[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
                tl.store(data_ptr + offsets, tl.reshape(codes, [ROWS, BLOCK]), mask=row_ok[:, None])
            else:
                pairs = tl.reshape(values, [ROWS * BLOCKS, CODE_BLOCK // 2, 2])
                codes, scale_bytes = encode_fp4_blocks(pairs, ENCODE)
                offsets = pool_row[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
                tl.store(data_ptr + offsets, tl.reshape(codes, [ROWS, BLOCK // 2]), mask=row_ok[:, None])
            tl.store(scales_ptr + scale_offsets, tl.reshape(scale_bytes, [ROWS, BLOCKS]), mask=row_ok[:, None])


def fused_store_takes(inputs: RopeRoundStoreInputs) -> bool:
    """Whether the one kernel takes these inputs: rows the row chain takes, 2-D, one pool row index each, into a
    contiguous pool of the rows' width (model dtype) or of their codes (a power-of-two width in whole blocks of
    a format the encoder has)."""
    x, store = inputs.chain.x, inputs.store
    data, scales, first, second = store.data, store.scales, store.first, store.second
    if x.dim() != 2 or not kernel_takes(inputs.chain):
        return False
    rows, width = x.shape
    if data.dim() != 3 or not data.is_contiguous() or data.device != x.device:
        return False
    if first.shape != (rows,) or second.shape != (rows,) or first.device != x.device or second.device != x.device:
        return False
    if scales is None:
        return data.dtype in OUT_DTYPES and data.shape[-1] == width
    code_block = store.block
    kind = encoding_kind(store.element, code_block, store.scale)
    if kind is None or width & (width - 1) or width % code_block or not scales.is_contiguous():
        return False
    return data.shape[-1] == (width if kind == 0 else width // 2) and scales.shape[-1] == width // code_block


@register("rope_round_store", "triton", devices=("cuda",), available=triton_available, priority=10)
def rope_round_store_triton(inputs: RopeRoundStoreInputs) -> None:
    """Same contract and pool bytes as the reference; one launch where :func:`fused_store_takes` holds, else the
    ``rope_and_round`` and ``cache_store`` backends one after the other."""
    if not fused_store_takes(inputs):
        return cache_store_triton(inputs.store_of(rope_and_round_triton(inputs.chain)))
    store = inputs.store
    data, scales, modulus = store.data, store.scales, store.modulus
    encode = PLAIN if scales is None else encoding_kind(store.element, store.block, store.scale)
    pool = data.view(torch.uint8) if scales is not None else data
    scale_bytes = scales.view(torch.uint8) if scales is not None else pool  # never read in model-dtype storage
    launch_chain(
        _chain_store_kernel, chain_rows_of(inputs.chain), pool, scale_bytes, store.first.contiguous(),
        store.second.contiguous(), data.shape[1], modulus or 0, rows_per_program=ROWS_PER_PROGRAM,
        warps=store_warps(inputs.chain.x.shape[-1]), ENCODE=encode, CODE_BLOCK=store.block if scales is not None else 1,
        HAS_MODULUS=modulus is not None,
    )  # fmt: skip
    return None
