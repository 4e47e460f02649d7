"""The routed-experts op as two Triton grouped GEMMs over the stacked experts, FP4 dequantised inside the kernel.

Why this shape:

* **Packed weights read once per block.** Decode is bound by the weight bytes: a step at 32 requests touches
  ~136 of 256 experts. Reading FP4 (0.53 bytes a weight with scales) instead of bf16 cuts those bytes ~3.8x.
  With bf16 activations (the model's path) each K step hands the packed bytes and one ue8m0 byte per 32 inputs
  to ``tl.dot_scaled``, whose Hopper lowering upcasts e2m1 with a few byte permutes and feeds wgmma: on the
  H200 that took T=1 from 0.28 to 0.10 ms and T=1024 from 17 to 3.1 ms against the hand-written bit arithmetic
  (which the fp32-activation path still uses, since ``tl.dot_scaled`` takes no fp32 operand).
* **Block-M over the aligned layout.** :func:`dsinfer.ops.moe.routing.align_slots` pads every expert's slots to
  whole ``BLOCK_M`` blocks, so a program multiplies one expert's weight tile with up to ``BLOCK_M`` gathered
  rows, and with ``BLOCK_M`` near the slots per expert (:func:`choose_config`) each tile is dequantised about
  once per step. The grid is sized from ``T``, ``k``, ``E`` and ``BLOCK_M`` on the host (the most blocks the
  layout can need); programs past the live block count (a device tensor) return at once. No host
  synchronisation, so the op can be captured in a CUDA graph. Up to ``FUSED_ROUTING_SLOTS`` slots the layout is
  one :func:`_align_kernel` launch instead of ~25 torch launches (20 against 55 us at T=1 in a graph).
* **Nibbles without interleaving (dense and fp32 path).** Byte ``j`` holds inputs ``2j`` (low nibble) and
  ``2j+1`` (high nibble), so the K loop does two half-width dots: even input columns of the activations times
  the low nibbles, odd columns times the high nibbles. Dense weights use the same two-dot loop over the two
  halves of the K tile.
* **SwiGLU in the first kernel's epilogue.** Each program accumulates a gate tile (``w13`` rows ``n``) and the
  matching up tile (rows ``I + n``), applies DeepSeek's clamps and ``silu(gate) * up`` in fp32, and stores the
  intermediate ``[T*k, I]`` by slot. The second kernel multiplies by ``w2``, scales by the routing weight and
  stores ``[T*k, H]`` by slot; the combine sums each token's k rows in one pass (``combine_triton.sum_slots``,
  torch's ``view(T, k, H).sum(1)`` in slot order): no atomics, and each slot is written by exactly one program,
  so the result does not depend on scheduling.

Numerics against the reference: fp32 accumulation in a different order, SwiGLU in fp32 before one rounding to
the activation dtype, and the k outputs of a token summed in fp32 once (the reference rounds after each add in
bf16). fp32 activations use ``input_precision="ieee"`` dots (no TF32).
"""

from __future__ import annotations

import torch

from dsinfer.ops.moe import decode_triton
from dsinfer.ops.moe.combine_triton import sum_slots
from dsinfer.ops.moe.reference import check_inputs
from dsinfer.ops.moe.routing import AlignedSlots, align_slots, max_aligned_blocks, sort_slots
from dsinfer.ops.moe.weights import ExpertWeights
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import (  # None without Triton: CPU installs use the reference
    tl,
    triton,
    triton_available,
)

__all__ = ["KernelConfig", "align_slots_fused", "choose_config", "routed_moe_triton", "triton_available"]

JIT_FUNCTIONS = (
    "_e2m1_values",
    "_ue8m0_scales",
    "_load_a",
    "_load_w",
    "_fp4_tiles",
    "_fp4_dot",
    "_load_a_tile",
    "_half_dots",
    "_program_tile",
    "_load_block",
    "_gate_up_kernel",
    "_down_kernel",
    "_swiglu_kernel",
    "_combine_kernel",
    "_add",
    "_align_kernel",
)
"""Every ``triton.jit`` function here (the interpreter tests wrap each one)."""


class KernelConfig(tuple):
    """``(block_m, block_n, block_k, num_warps, num_stages, swap_ab, columns_first, split_k)``; ``block_k >= 32``
    (one FP4 scale group, and each half-dot of the dense/fp32 path has K >= 16).

    ``swap_ab`` (FP4 weights with bf16 activations only) computes ``(W x^T)^T``: the weight tile is the MMA's
    left operand, ``BLOCK_N`` weight rows fill its M dimension and the few rows of a decode block its N. It was
    meant for decode but measured slower on the H200 at every T (Triton 3.6); kept as a tested option for
    other chips and compilers, unused by :func:`choose_config`.

    ``columns_first``: the order of the programs (see ``_program_tile``).

    ``split_k`` (a power of two): each output tile's K range is split over that many programs, which store fp32
    partial sums; a second small kernel per GEMM adds them in split order (SwiGLU after the first GEMM; routing
    weights and the top-k combine after the second). A decode step of one or two tokens has only a few hundred
    (block, N tile) programs, each walking all of K one dependent load after the other; splitting K shortens
    that chain (:func:`decode_split`)."""

    def __new__(
        cls,
        block_m: int,
        block_n: int,
        block_k: int,
        num_warps: int = 4,
        num_stages: int = 3,
        swap_ab: bool = False,
        columns_first: bool = True,
        split_k: int = 1,
    ):
        for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if block_k < 32:
            raise ValueError(f"block_k must be >= 32, got {block_k}")
        if split_k < 1 or split_k & (split_k - 1):
            raise ValueError(f"split_k must be a power of two >= 1, got {split_k}")
        flags = (bool(swap_ab), bool(columns_first), int(split_k))
        return super().__new__(cls, (block_m, block_n, block_k, num_warps, num_stages, *flags))


SPLIT_TARGET_PROGRAMS = 512  # about four programs per SM of an H200: fewer (block, N tile) programs split K
MAX_SPLIT_K = 8
MIN_K_STEPS_PER_SPLIT = 4  # a split walks at least this many BLOCK_K steps


def decode_split(num_slots: int, num_experts: int, config: KernelConfig, inter: int, hidden: int) -> int:
    """The K split for a step too small to fill the GPU: the power of two that brings the gate/up GEMM's
    (block, N tile) programs to about SPLIT_TARGET_PROGRAMS, keeping each split MIN_K_STEPS_PER_SPLIT steps
    long (in the shorter K of the two GEMMs); 1 when the step fills the GPU already."""
    block_m, block_n, block_k = config[:3]
    programs = max_aligned_blocks(num_slots, num_experts, block_m) * -(-inter // block_n)
    split = 1
    while (
        split < MAX_SPLIT_K
        and programs * split < SPLIT_TARGET_PROGRAMS
        and min(hidden, inter) // (2 * split * block_k) >= MIN_K_STEPS_PER_SPLIT
    ):
        split *= 2
    return split


def choose_config(num_slots: int, num_experts: int, fp4_dot: bool = True) -> KernelConfig:
    """Block sizes from host-known sizes only (so the choice is the same in a captured graph and eagerly).

    ``BLOCK_M`` follows the average slots per expert, so a block is mostly real rows and each expert's weight
    tile is dequantised about once per step. ``fp4_dot`` (FP4 weights, bf16 activations: the
    ``tl.dot_scaled`` path) takes the configurations measured fastest on the H200 (``benchmarks/moe_kernel.py
    --sweep``, V4-Flash widths); the dense and fp32 paths keep configurations chosen only to compile for sm_90
    without register spills or too much shared memory."""
    average = num_slots / max(num_experts, 1)
    if not fp4_dot:
        if average <= 16:
            return KernelConfig(16, 64, 128, 8, 4)
        if average <= 32:
            return KernelConfig(32, 64, 128, 8, 3)
        return KernelConfig(64, 64, 64, 8, 3)
    if average <= 8:  # decode: measured at 0.02 and 0.75 slots per expert (T = 1 and 32 at top-6 of 256)
        return KernelConfig(16, 64, 128, 4, 4)
    if average <= 48:  # measured at 24 (T = 1024)
        return KernelConfig(32, 64, 128, 4, 3)
    # Measured at 96 and 384 (T = 4096 and 16384): 5.07 and 16.6 ms against 6.18 and 19.6 for (128, 128, 64, 8, 3);
    # four warps and four stages leave room for two programs per SM, which hides the unpipelined loads' latency.
    return KernelConfig(128, 64, 64, 4, 4)


if triton is not None:

    @triton.jit
    def _e2m1_values(codes):
        """int32 e2m1 codes (0..15) -> float32: bit 3 the sign, magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6."""
        magnitude = codes & 7
        # m >= 2 is 2**((m >> 1) - 1) * (1 + (m & 1) / 2): exponent bits (m >> 1) + 126, mantissa top bit m & 1.
        normal = (((magnitude >> 1) + 126) << 23) | ((magnitude & 1) << 22)
        bits = tl.where(magnitude >= 2, normal, tl.where(magnitude == 1, 0x3F000000, 0))
        bits = bits | ((codes & 8) << 28)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _ue8m0_scales(exponents):
        """int32 ue8m0 bytes -> float32 ``2**(byte - 127)``: bits ``byte << 23``, but 0 is the subnormal
        2**-127 and 255 is NaN."""
        bits = tl.where(exponents == 0, 0x00400000, exponents << 23)
        bits = tl.where(exponents == 255, 0x7FC00000, bits)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _load_a(a_rows, a_ok, k0, K, FP4: tl.constexpr, BLOCK_K: tl.constexpr):
        """The activation half-tiles ``(a_lo, a_hi)`` ``[M, BK/2]`` of one K step.

        FP4: ``lo`` are the even inputs ``2j`` of the tile (they meet the low nibbles), ``hi`` the odd ones.
        Dense: ``lo`` are inputs ``k0 .. k0+BK/2-1``, ``hi`` the next half."""
        HALF: tl.constexpr = BLOCK_K // 2
        half = tl.arange(0, HALF)
        if FP4:
            lo_columns = k0 + 2 * half
            hi_columns = lo_columns + 1
        else:
            lo_columns = k0 + half
            hi_columns = lo_columns + HALF
        a_lo = tl.load(a_rows + lo_columns[None, :], mask=a_ok[:, None] & (lo_columns < K)[None, :], other=0.0)
        a_hi = tl.load(a_rows + hi_columns[None, :], mask=a_ok[:, None] & (hi_columns < K)[None, :], other=0.0)
        return a_lo, a_hi

    @triton.jit
    def _load_w(
        w_base,
        s_base,
        w_rows,
        w_ok,
        w_row_stride,
        s_row_stride,
        k0,
        K,
        dtype: tl.constexpr,
        FP4: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """The weight half-tiles ``(w_lo, w_hi)`` ``[BK/2, N]`` of one K step, transposed for ``a @ w``, in ``dtype``.

        FP4: byte column ``j`` of the tile gives ``w_lo`` (low nibble, input ``2j``) and ``w_hi`` (high nibble,
        input ``2j+1``), each times its group's scale. Dense: the two halves of the K tile."""
        HALF: tl.constexpr = BLOCK_K // 2
        half = tl.arange(0, HALF)
        if FP4:
            byte_columns = k0 // 2 + half
            tile_ok = (byte_columns < K // 2)[:, None] & w_ok[None, :]
            packed = tl.load(w_base + w_rows[None, :] * w_row_stride + byte_columns[:, None], mask=tile_ok, other=0).to(
                tl.int32
            )
            exponents = tl.load(
                s_base + w_rows[None, :] * s_row_stride + (byte_columns // 16)[:, None], mask=tile_ok, other=127
            ).to(tl.int32)
            scales = _ue8m0_scales(exponents)
            w_lo = (_e2m1_values(packed & 15) * scales).to(dtype)
            w_hi = (_e2m1_values(packed >> 4) * scales).to(dtype)
        else:
            lo_columns = k0 + half
            hi_columns = lo_columns + HALF
            row_offsets = w_base + w_rows[None, :] * w_row_stride
            w_lo = tl.load(row_offsets + lo_columns[:, None], mask=(lo_columns < K)[:, None] & w_ok[None, :], other=0.0)
            w_hi = tl.load(row_offsets + hi_columns[:, None], mask=(hi_columns < K)[:, None] & w_ok[None, :], other=0.0)
            w_lo = w_lo.to(dtype)
            w_hi = w_hi.to(dtype)
        return w_lo, w_hi

    @triton.jit
    def _fp4_tiles(w_base, s_base, w_rows, w_ok, w_row_stride, s_row_stride, k0, K, SWAP: tl.constexpr, BLOCK_K):
        """The packed FP4 bytes and ue8m0 bytes of ``W[w_rows, k0 : k0 + BLOCK_K]`` as :func:`_fp4_dot` takes them
        (``SWAP``: ``[N, BK/2]``, else ``[BK/2, N]``; scales ``[N, BK/32]``)."""
        byte_columns = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte_ok = byte_columns < K // 2
        groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        scale_mask = w_ok[:, None] & (groups < K // 32)[None, :]
        scale = tl.load(s_base + w_rows[:, None] * s_row_stride + groups[None, :], mask=scale_mask, other=127)
        if SWAP:
            packed = tl.load(
                w_base + w_rows[:, None] * w_row_stride + byte_columns[None, :],
                mask=w_ok[:, None] & byte_ok[None, :],
                other=0,
            )
        else:
            packed = tl.load(
                w_base + w_rows[None, :] * w_row_stride + byte_columns[:, None],
                mask=byte_ok[:, None] & w_ok[None, :],
                other=0,
            )
        return packed, scale

    @triton.jit
    def _fp4_dot(acc, a, packed, scale, SWAP: tl.constexpr):
        """``acc + a @ W^T`` through ``tl.dot_scaled`` (bf16 ``a`` ``[M, BK]``, the FP4 tile of :func:`_fp4_tiles`).

        The packed bytes and one ue8m0 byte per 32 inputs go to the compiler's own e2m1 upcast, the cheapest
        dequantisation Triton offers (the bit arithmetic of :func:`_load_w` costs several integer operations per
        weight). ``SWAP`` keeps ``acc`` transposed, ``[N, M]``, with the weight tile as the left operand. Scale
        byte 255 (NaN) is not propagated (``fast_math``): checkpoints never hold it."""
        if SWAP:
            acc = tl.dot_scaled(packed, scale, "e2m1", tl.trans(a), None, "bf16", acc, fast_math=True)
        else:
            acc = tl.dot_scaled(a, None, "bf16", packed, scale, "e2m1", acc, fast_math=True)
        return acc

    @triton.jit
    def _load_a_tile(a_rows, a_ok, k0, K, BLOCK_K: tl.constexpr):
        """Activation tile ``[M, BLOCK_K]`` at inputs ``k0 ..`` (zeros past ``K`` and for padding rows)."""
        k = k0 + tl.arange(0, BLOCK_K)
        return tl.load(a_rows + k[None, :], mask=a_ok[:, None] & (k < K)[None, :], other=0.0)

    @triton.jit
    def _half_dots(acc, a_lo, a_hi, w_lo, w_hi, IEEE: tl.constexpr):
        """``acc + a_lo @ w_lo + a_hi @ w_hi`` (fp32 activations: IEEE fp32 dots, no TF32)."""
        if IEEE:
            acc = tl.dot(a_lo, w_lo, acc, input_precision="ieee")
            return tl.dot(a_hi, w_hi, acc, input_precision="ieee")
        acc = tl.dot(a_lo, w_lo, acc)
        return tl.dot(a_hi, w_hi, acc)

    @triton.jit
    def _program_tile(max_blocks, n_tiles, COLUMNS_FIRST: tl.constexpr, SPLIT_K: tl.constexpr):
        """``(block, n_tile, split)`` of this program in the 1-D grid of ``max_blocks * n_tiles * SPLIT_K``
        programs (the K splits of one output tile are neighbours).

        ``COLUMNS_FIRST``: consecutive programs take the N tiles of one row block, so its gathered activation rows
        are read from HBM once and then from L2, and the few experts in flight keep their weights in L2 too.
        Otherwise consecutive programs take the row blocks of one N tile, and every N tile re-reads all the
        activations (at T=16384, top-6: 0.8 GB for each of gate/up's 16 N tiles)."""
        pid = tl.program_id(0)
        split = pid % SPLIT_K
        pid = pid // SPLIT_K
        if COLUMNS_FIRST:
            return pid // n_tiles, pid % n_tiles, split
        return pid % max_blocks, pid // max_blocks, split

    @triton.jit
    def _load_block(slot_ids_ptr, block_expert_ptr, num_blocks_ptr, num_slots, block, BLOCK_M: tl.constexpr):
        """``(live, expert, slots, slot_ok)`` of row block ``block``; ``live`` is False past the live blocks."""
        live = block < tl.load(num_blocks_ptr)
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        slots = tl.load(slot_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        return live, expert, slots, slots < num_slots

    @triton.jit
    def _gate_up_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        slot_ids_ptr,
        block_expert_ptr,
        num_blocks_ptr,
        h_ptr,
        partial_ptr,
        num_slots,
        top_k,
        hidden,
        inter,
        limit,
        x_row_stride,
        w_expert_stride,
        w_row_stride,
        s_expert_stride,
        s_row_stride,
        max_blocks,
        n_tiles,
        k_per_split,
        FP4: tl.constexpr,
        FP4_DOT: tl.constexpr,
        SWAP: tl.constexpr,
        IEEE: tl.constexpr,
        COLUMNS_FIRST: tl.constexpr,
        SPLIT_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """``h[slot, n] = silu(min(x w1^T, limit)) * clamp(x w3^T, -limit, limit)`` for one block of one expert."""
        block, n_tile, split = _program_tile(max_blocks, n_tiles, COLUMNS_FIRST, SPLIT_K)
        live, expert, slots, slot_ok = _load_block(
            slot_ids_ptr, block_expert_ptr, num_blocks_ptr, num_slots, block, BLOCK_M
        )
        if not live:
            return
        tokens = tl.where(slot_ok, slots // top_k, 0)
        a_rows = x_ptr + tokens[:, None] * x_row_stride
        columns = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        column_ok = columns < inter
        w_base = w_ptr + expert * w_expert_stride
        s_base = s_ptr + expert * s_expert_stride
        if FP4_DOT:
            if SWAP:
                gate = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
                up = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
            else:
                gate = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
                up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            # No prefetching of step k0 + BLOCK_K into registers: measured slower on the H200 at every T.
            strides = (w_row_stride, s_row_stride)
            for k0 in range(split * k_per_split, tl.minimum((split + 1) * k_per_split, hidden), BLOCK_K):
                a = _load_a_tile(a_rows, slot_ok, k0, hidden, BLOCK_K)
                g_w, g_s = _fp4_tiles(w_base, s_base, columns, column_ok, *strides, k0, hidden, SWAP, BLOCK_K)
                gate = _fp4_dot(gate, a, g_w, g_s, SWAP)
                u_w, u_s = _fp4_tiles(w_base, s_base, columns + inter, column_ok, *strides, k0, hidden, SWAP, BLOCK_K)
                up = _fp4_dot(up, a, u_w, u_s, SWAP)
            if SWAP:
                gate = tl.trans(gate)
                up = tl.trans(up)
        else:
            gate = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for k0 in range(split * k_per_split, tl.minimum((split + 1) * k_per_split, hidden), BLOCK_K):
                a_lo, a_hi = _load_a(a_rows, slot_ok, k0, hidden, FP4, BLOCK_K)
                dtype = a_lo.dtype
                w_lo, w_hi = _load_w(
                    w_base, s_base, columns, column_ok, w_row_stride, s_row_stride, k0, hidden, dtype, FP4, BLOCK_K
                )
                u_lo, u_hi = _load_w(
                    w_base, s_base, columns + inter, column_ok, w_row_stride, s_row_stride, k0, hidden, dtype, FP4,
                    BLOCK_K,
                )  # fmt: skip
                gate = _half_dots(gate, a_lo, a_hi, w_lo, w_hi, IEEE)
                up = _half_dots(up, a_lo, a_hi, u_lo, u_hi, IEEE)
        tile_ok = slot_ok[:, None] & column_ok[None, :]
        if SPLIT_K > 1:  # partial sums; _swiglu_kernel adds the splits and applies the activation
            rows = (split * num_slots + tl.where(slot_ok, slots, 0)).to(tl.int64)
            partial = partial_ptr + rows[:, None] * (2 * inter) + columns[None, :]
            tl.store(partial, gate, mask=tile_ok)
            tl.store(partial + inter, up, mask=tile_ok)
        else:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            hidden_act = gate / (1.0 + tl.exp(-gate)) * up
            out = h_ptr + slots.to(tl.int64)[:, None] * inter + columns[None, :]
            tl.store(out, hidden_act.to(h_ptr.dtype.element_ty), mask=tile_ok)

    @triton.jit
    def _down_kernel(
        h_ptr,
        w_ptr,
        s_ptr,
        slot_ids_ptr,
        block_expert_ptr,
        num_blocks_ptr,
        route_weight_ptr,
        out_ptr,
        partial_ptr,
        num_slots,
        hidden,
        inter,
        w_expert_stride,
        w_row_stride,
        s_expert_stride,
        s_row_stride,
        max_blocks,
        n_tiles,
        k_per_split,
        FP4: tl.constexpr,
        FP4_DOT: tl.constexpr,
        SWAP: tl.constexpr,
        IEEE: tl.constexpr,
        COLUMNS_FIRST: tl.constexpr,
        SPLIT_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """``out[slot, n] = route_weight[slot] * (h[slot] w2^T)[n]`` for one block of one expert."""
        block, n_tile, split = _program_tile(max_blocks, n_tiles, COLUMNS_FIRST, SPLIT_K)
        live, expert, slots, slot_ok = _load_block(
            slot_ids_ptr, block_expert_ptr, num_blocks_ptr, num_slots, block, BLOCK_M
        )
        if not live:
            return
        safe_slots = tl.where(slot_ok, slots, 0).to(tl.int64)
        a_rows = h_ptr + safe_slots[:, None] * inter
        columns = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        column_ok = columns < hidden
        w_base = w_ptr + expert * w_expert_stride
        s_base = s_ptr + expert * s_expert_stride
        if FP4_DOT:
            if SWAP:
                acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
            else:
                acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            strides = (w_row_stride, s_row_stride)
            for k0 in range(split * k_per_split, tl.minimum((split + 1) * k_per_split, inter), BLOCK_K):
                a = _load_a_tile(a_rows, slot_ok, k0, inter, BLOCK_K)
                w, w_s = _fp4_tiles(w_base, s_base, columns, column_ok, *strides, k0, inter, SWAP, BLOCK_K)
                acc = _fp4_dot(acc, a, w, w_s, SWAP)
            if SWAP:
                acc = tl.trans(acc)
        else:
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for k0 in range(split * k_per_split, tl.minimum((split + 1) * k_per_split, inter), BLOCK_K):
                a_lo, a_hi = _load_a(a_rows, slot_ok, k0, inter, FP4, BLOCK_K)
                w_lo, w_hi = _load_w(
                    w_base, s_base, columns, column_ok, w_row_stride, s_row_stride, k0, inter, a_lo.dtype, FP4, BLOCK_K
                )
                acc = _half_dots(acc, a_lo, a_hi, w_lo, w_hi, IEEE)
        tile_ok = slot_ok[:, None] & column_ok[None, :]
        if SPLIT_K > 1:  # partial sums; _combine_kernel adds the splits, weights and combines the slots
            rows = split * num_slots + safe_slots
            tl.store(partial_ptr + rows[:, None] * hidden + columns[None, :], acc, mask=tile_ok)
        else:
            route_weight = tl.load(route_weight_ptr + safe_slots, mask=slot_ok, other=0.0)
            acc = acc * route_weight[:, None]
            out = out_ptr + safe_slots[:, None] * hidden + columns[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tile_ok)

    @triton.jit
    def _swiglu_kernel(partial_ptr, h_ptr, num_slots, inter, limit, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """``h`` of one slot and column tile from the split-K partial gate and up sums (added in split order)."""
        slot = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        column_ok = columns < inter
        rows = tl.arange(0, SPLIT_K).to(tl.int64) * num_slots + slot
        partial = partial_ptr + rows[:, None] * (2 * inter) + columns[None, :]
        gate = tl.reduce(tl.load(partial, mask=column_ok[None, :], other=0.0), 0, _add)
        up = tl.reduce(tl.load(partial + inter, mask=column_ok[None, :], other=0.0), 0, _add)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        hidden_act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(h_ptr + slot * inter + columns, hidden_act.to(h_ptr.dtype.element_ty), mask=column_ok)

    @triton.jit
    def _combine_kernel(
        partial_ptr,
        route_weight_ptr,
        out_ptr,
        num_slots,
        top_k,
        hidden,
        SPLIT_K: tl.constexpr,
        TOP_K: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One token's output tile: each of its slots' split-K partial sums added in split order, times the
        slot's routing weight, then the slots added (all in fp32, one rounding to the output dtype)."""
        token = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        column_ok = columns < hidden
        choice = tl.arange(0, TOP_K)
        choice_ok = choice < top_k
        slots = token * top_k + choice
        split = tl.arange(0, SPLIT_K).to(tl.int64)
        rows = split[:, None] * num_slots + slots[None, :]
        mask = choice_ok[None, :, None] & column_ok[None, None, :]
        partial = tl.load(partial_ptr + rows[:, :, None] * hidden + columns[None, None, :], mask=mask, other=0.0)
        route_weight = tl.load(route_weight_ptr + slots, mask=choice_ok, other=0.0)
        out = tl.reduce(tl.reduce(partial, 0, _add) * route_weight[:, None], 0, _add)
        tl.store(out_ptr + token * hidden + columns, out.to(out_ptr.dtype.element_ty), mask=column_ok)

    @triton.jit
    def _add(a, b):
        """The combine of the sums below (``tl.reduce``/``tl.associative_scan`` are builtins the interpreter
        runs; ``tl.sum``/``tl.cumsum`` are library jit functions it does not wrap)."""
        return a + b

    @triton.jit
    def _align_kernel(
        ids_ptr,
        slot_ids_ptr,
        block_expert_ptr,
        num_blocks_ptr,
        block_ends_ptr,
        num_slots,
        num_experts,
        max_blocks,
        BLOCK_M: tl.constexpr,
        SLOTS: tl.constexpr,
        BINS: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        """:func:`dsinfer.ops.moe.routing.align_slots` of ``sort_slots(ids)`` in one program (``SLOTS >= num_slots``).

        Why: the torch version is ~25 tiny launches, which at decode cost more than the expert GEMMs. Counts are
        a histogram (bin ``num_experts`` takes the padding), an entry's place inside its expert is the number of
        earlier entries with the same expert (stable, like the reference's sort), and its expert's first block is
        read back from ``block_ends`` after a barrier."""
        entries = tl.arange(0, SLOTS)
        ids = tl.load(ids_ptr + entries, mask=entries < num_slots, other=num_experts).to(tl.int32)
        bins = tl.arange(0, BINS)
        real_bin = bins < num_experts
        blocks = tl.where(real_bin, (tl.histogram(ids, BINS) + BLOCK_M - 1) // BLOCK_M, 0)
        ends = tl.associative_scan(blocks, 0, _add)
        total = tl.reduce(blocks, 0, _add)
        tl.store(block_ends_ptr + bins, ends.to(tl.int64), mask=real_bin)
        tl.store(num_blocks_ptr, total.to(tl.int64))
        for start in range(0, max_blocks, CHUNK):
            block = start + tl.arange(0, CHUNK)
            owner = tl.reduce(((ends[None, :] <= block[:, None]) & real_bin[None, :]).to(tl.int32), 1, _add)
            owner = tl.where(block < total, owner, -1)
            tl.store(block_expert_ptr + block, owner.to(tl.int64), mask=block < max_blocks)
        for start in range(0, max_blocks * BLOCK_M, CHUNK * BLOCK_M):
            position = start + tl.arange(0, CHUNK * BLOCK_M)
            pad = tl.full((CHUNK * BLOCK_M,), 0, tl.int64) + num_slots
            tl.store(slot_ids_ptr + position, pad, mask=position < max_blocks * BLOCK_M)
        tl.debug_barrier()  # block_ends and the padding are written; the scatter below reads and overwrites them
        for start in range(0, num_slots, CHUNK):
            entry = start + tl.arange(0, CHUNK)
            entry_ok = entry < num_slots
            expert = tl.load(ids_ptr + entry, mask=entry_ok, other=num_experts).to(tl.int32)
            earlier = (ids[None, :] == expert[:, None]) & (entries[None, :] < entry[:, None])
            rank = tl.reduce(earlier.to(tl.int32), 1, _add)
            first_block = tl.load(block_ends_ptr + expert - 1, mask=entry_ok & (expert > 0), other=0, volatile=True)
            tl.store(slot_ids_ptr + first_block * BLOCK_M + rank, entry.to(tl.int64), mask=entry_ok)


FUSED_ROUTING_SLOTS = 1024
"""Up to this many slots (decode and small prefill) the routing layout is one :func:`_align_kernel` launch."""


def align_slots_fused(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedSlots:
    """The same :class:`AlignedSlots` as ``align_slots(sort_slots(expert_ids, E), block_m)``, in one launch.

    Only for ``T*k <= FUSED_ROUTING_SLOTS`` (one program holds every slot); the tests compare the two exactly."""
    num_slots = expert_ids.numel()
    if not 0 < num_slots <= FUSED_ROUTING_SLOTS:
        raise ValueError(f"align_slots_fused takes 1 .. {FUSED_ROUTING_SLOTS} slots, got {num_slots}")
    device = expert_ids.device
    max_blocks = max_aligned_blocks(num_slots, num_experts, block_m)
    slot_ids = torch.empty(max_blocks * block_m, dtype=torch.int64, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int64, device=device)
    num_blocks = torch.empty(1, dtype=torch.int64, device=device)
    block_ends = torch.empty(num_experts, dtype=torch.int64, device=device)
    _align_kernel[(1,)](
        expert_ids.reshape(-1), slot_ids, block_expert, num_blocks, block_ends, num_slots, num_experts, max_blocks,
        BLOCK_M=block_m, SLOTS=triton.next_power_of_2(num_slots), BINS=triton.next_power_of_2(num_experts + 1),
        CHUNK=32, num_warps=8,
    )  # fmt: skip
    return AlignedSlots(slot_ids, block_expert, num_blocks, block_ends, num_slots, block_m)


@register(
    "routed_moe",
    "triton",
    devices=("cuda",),
    dtypes=(torch.bfloat16, torch.float32),
    available=triton_available,
    priority=20,
)
def routed_moe_triton(
    x: torch.Tensor,
    weights: ExpertWeights,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    swiglu_limit: float,
    *,
    slot_of_expert: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    gemv: bool | None = None,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` in ``x.dtype`` (bf16 or fp32 activations; FP4 or dense weights).

    ``config`` overrides the block sizes (tests use small ones); by default :func:`choose_config` picks them
    from host-known sizes. Allocates ``[T*k, I]`` and ``[T*k, H]`` scratch in ``x.dtype``.

    ``gemv``: steps of at most ``decode_triton.DECODE_GEMV_MAX_TOKENS`` tokens over FP4 experts (and no
    ``config``) take the two GEMV kernels of :mod:`dsinfer.ops.moe.decode_triton` instead; ``False`` forces
    the grouped kernels, ``True`` the GEMV path.
    """
    if triton is None:
        raise RuntimeError("the triton routed_moe backend needs Triton installed")
    routed_experts = weights.num_experts if slot_of_expert is None else slot_of_expert.numel()  # sizes the tiles
    if slot_of_expert is not None:  # offloaded experts: read each at its slot (a gather on the device)
        expert_ids = slot_of_expert[expert_ids]
    check_inputs(x, weights, expert_ids, expert_weights)
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the triton routed_moe backend takes bf16 or fp32 activations, got {x.dtype}")
    if gemv is None:
        gemv = config is None and decode_triton.use_decode_gemv(x, weights, expert_ids)
    if gemv:
        return decode_triton.routed_moe_decode_gemv(x, weights, expert_ids, expert_weights, swiglu_limit)
    num_slots = expert_ids.numel()
    if num_slots == 0:
        return torch.zeros_like(x)
    if config is None:
        fp4_dot = weights.is_fp4 and x.dtype == torch.bfloat16
        config = choose_config(num_slots, routed_experts, fp4_dot)
        split = decode_split(num_slots, routed_experts, config, weights.intermediate_size, weights.hidden_size)
        config = KernelConfig(*config[:-1], split_k=split)
    return grouped_moe_launch(x, weights, expert_ids, expert_weights, swiglu_limit, config)


def grouped_moe_launch(
    x: torch.Tensor,
    weights: ExpertWeights,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    swiglu_limit: float,
    config: KernelConfig,
) -> torch.Tensor:
    """The grouped kernels of :func:`routed_moe_triton` with ``config`` (checked inputs, at least one slot): the
    slots aligned to ``config``'s row blocks, the gate-up and down GEMMs, and the split-K partial sums' swiglu and
    combine where ``config`` splits."""
    tokens, top_k = expert_ids.shape
    num_slots = tokens * top_k
    hidden, inter = weights.hidden_size, weights.intermediate_size
    fp4_dot = weights.is_fp4 and x.dtype == torch.bfloat16  # tl.dot_scaled takes bf16, not fp32, activations
    block_m, block_n, block_k, num_warps, num_stages, swap_ab, columns_first, split_k = config
    if num_slots <= FUSED_ROUTING_SLOTS:
        aligned = align_slots_fused(expert_ids, weights.num_experts, block_m)
    else:
        aligned = align_slots(sort_slots(expert_ids, weights.num_experts), block_m)
    x = x.contiguous()
    route_weight = expert_weights.reshape(-1).contiguous()
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    # Dense weights have no scales; any tensor stands in for the pointer (FP4=False never reads it).
    w13_scale = weights.w13_scale if weights.is_fp4 else weights.w13
    w2_scale = weights.w2_scale if weights.is_fp4 else weights.w2
    common = dict(
        FP4=weights.is_fp4, FP4_DOT=fp4_dot, SWAP=swap_ab and fp4_dot, IEEE=x.dtype == torch.float32,
        COLUMNS_FIRST=columns_first, SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    launch = dict(num_warps=num_warps, num_stages=num_stages)
    blocks, up_tiles, down_tiles = aligned.max_blocks, triton.cdiv(inter, block_n), triton.cdiv(hidden, block_n)

    def per_split(k: int) -> int:  # whole BLOCK_K steps per split
        return triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k

    if split_k > 1:
        up_partial = torch.empty(split_k, num_slots, 2 * inter, dtype=torch.float32, device=x.device)
        down_partial = torch.empty(split_k, num_slots, hidden, dtype=torch.float32, device=x.device)
        out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    else:
        up_partial = down_partial = h  # not read without a split
        out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks * up_tiles * split_k,)](
        x, weights.w13, w13_scale, aligned.slot_ids, aligned.block_expert, aligned.num_blocks, h, up_partial,
        num_slots, top_k, hidden, inter, float(swiglu_limit), x.stride(0),
        weights.w13.stride(0), weights.w13.stride(1), w13_scale.stride(0), w13_scale.stride(1), blocks, up_tiles,
        per_split(hidden), **common, **launch,
    )  # fmt: skip
    if split_k > 1:
        _swiglu_kernel[(num_slots, up_tiles)](
            up_partial, h, num_slots, inter, float(swiglu_limit), SPLIT_K=split_k, BLOCK_N=block_n
        )
    _down_kernel[(blocks * down_tiles * split_k,)](
        h, weights.w2, w2_scale, aligned.slot_ids, aligned.block_expert, aligned.num_blocks, route_weight, out,
        down_partial, num_slots, hidden, inter,
        weights.w2.stride(0), weights.w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), blocks, down_tiles,
        per_split(inter), **common, **launch,
    )  # fmt: skip
    if split_k > 1:
        _combine_kernel[(tokens, down_tiles)](
            down_partial, route_weight, out, num_slots, top_k, hidden,
            SPLIT_K=split_k, TOP_K=triton.next_power_of_2(top_k), BLOCK_N=block_n,
        )  # fmt: skip
        return out
    if top_k == 1:
        return out
    return sum_slots(out, tokens, top_k)
