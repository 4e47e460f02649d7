"""The routed-experts op for decode steps of a few tokens: two GEMV kernels over the packed FP4 experts.

Why a separate path: at ``T = 1`` (top-6 of 256, hidden 4096, intermediate 2048) the grouped kernels of
:mod:`dsinfer.ops.moe.triton` spend ~4x the time it takes to read the six experts' FP4 bytes: their
``tl.dot`` tiles have at least 16 rows for a few real ones, and the split-K path adds launches for the
routing layout, the SwiGLU and the combine. Here each weight is read once, decoded in registers and multiplied
on the CUDA cores (fp32 multiply-add, no ``tl.dot``), in two launches and without any routing layout:

* :func:`_gate_up_gemv_kernel`: one program per (slot, tile of ``BLOCK_N`` intermediate columns). It reads the
  slot's expert id from ``expert_ids`` on the device (no host read, no sort: CUDA-graph safe), walks ``K =
  hidden`` in ``BLOCK_K`` steps over the gate rows and the matching up rows of the tile and writes the slot's
  ``h = clamped_swiglu(gate, up)`` in ``x.dtype``.
* :func:`_down_gemv_kernel`: one program per (token, tile of ``BLOCK_N`` hidden columns, split of the token's
  slots). It walks its slots in slot order and ``K = intermediate`` in one flat loop and adds each slot's
  ``h w2^T`` times its routing weight into one fp32 sum. Unsplit it stores the row tile in ``x.dtype`` once;
  split, the last split of a tile to arrive adds the splits' fp32 sums in split order (deterministic: a count
  per tile, no atomic additions of values) and stores it.

The decode, and why it is not the grouped kernels' ``_e2m1_values``: a GEMV has one multiply-add per weight,
so the per-weight integer work of the decode sets the speed. The codes are read as ``int32`` words (eight
e2m1 codes, inputs ``8q .. 8q+7``: byte ``b`` holds input ``8q+2b`` in its low nibble, the checkpoint's order;
code ``n`` of a word sits at bits ``4n .. 4n+3``). Codes ``p`` and ``p+4`` of a word are moved together, with
one shift and one mask each for the magnitude and the sign, into the two halves of a word as float16 bit
patterns (magnitude bits at 9..11, sign at 15). Read as float16, ``e1 e0 m`` at the low exponent and top
mantissa bits is exactly ``e2m1 * 2**-14``: the e2m1 subnormal (code 1, 0.5) becomes the float16 subnormal
``2**-15``, and the float16 -> float32 conversion is exact (compiled, two ``cvt.f32.f16`` of the word's halves in
inline PTX; interpreted, int16 casts). Each 32-input group's sum is multiplied by ``2**14`` and by its ue8m0
scale (``_ue8m0_scales``' semantics: byte 0 is ``2**-127``, 255 is NaN), both exact. That is about two integer
operations, one conversion and one fp32 multiply-add per weight; with the loads, the group sums and the loop,
sm_90 SASS of the default launches (Triton 3.9) has ~5.2 (gate/up) and ~5.3 (down) instructions a weight in the
loops, where the bit arithmetic of ``_e2m1_values`` alone takes about a dozen.

Loads: a K step of a tile is ``[BLOCK_N, BLOCK_K / 8]`` words, each row's 16 bytes of one scale group
contiguous (one 16-byte load per thread and group, a warp's groups side by side along the row); a group's
scale byte is one more load, and each thread reads the activations of its group once per step for all of its
rows. Every step's loads are issued one step ahead, in registers. Keep ``BLOCK_K <= 256 * num_warps``: with
more, a step's activation planes (``BLOCK_K / 8`` elements each) have as many elements as the program has
threads, Triton stops loading them in the layout that uses them and converts them through shared memory.

Numerics, against :func:`dsinfer.ops.moe.reference.routed_moe_reference`: the products and sums are fp32
(exact weights; only the order of the fp32 additions differs). The first kernel rounds like the reference
(``F.linear`` output rounded to ``x.dtype``, clamped, SiLU rounded, product rounded: the rounding of the
``clamped_swiglu`` op); the second keeps the routing-weighted sum over slots in fp32 and rounds once, like the
grouped backend's ``_combine_kernel`` (the reference rounds after each expert's ``index_add_``); its routing
weight multiplies each group's partial sum rather than the slot's total, a difference of fp32 rounding only.
Expert ids outside ``0 .. E-1`` are never read: such a slot contributes zeros.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsinfer import envs
from dsinfer.ops.dependent_launch import dependent_launch
from dsinfer.ops.inline_ptx import inline_ptx_available
from dsinfer.ops.moe.reference import check_inputs
from dsinfer.ops.moe.weights import ExpertWeights
from dsinfer.ops.split_arrivals import arrival_counts
from dsinfer.ops.triton_support import tl, triton

if triton is not None:  # Triton is optional: CPU-only installs use the reference.
    from dsinfer.ops.dependent_launch import allow_dependents

__all__ = [
    "DECODE_GEMV_CONFIG",
    "DECODE_GEMV_MAX_TOKENS",
    "DOWN_SPLITS",
    "MIN_SLOTS_PER_SPLIT",
    "DecodeGemvConfig",
    "GemvConfig",
    "decode_gemv_config",
    "routed_moe_decode_gemv",
    "use_decode_gemv",
]

DECODE_GEMV_MAX_TOKENS = envs.MOE_GEMV_MAX_TOKENS.get()
"""Steps of at most this many tokens (with packed FP4 experts) take the GEMV path in ``routed_moe_triton``
(``DSINFER_MOE_GEMV_MAX_TOKENS``; 0 turns the path off). On the H200 (``benchmarks/moe_kernel.py --decode-gemv
[--sweep]``, CUDA graph, V4-Flash widths, top-6 of 256, Triton 3.6), the GEMV with :data:`DECODE_GEMV_CONFIG`
against the grouped kernels:

======  ==========  ==========  ====================================
tokens  GEMV ms     grouped ms  expert bytes read (GEMV / grouped)
======  ==========  ==========  ====================================
1       0.0476      0.0810      1.69 / 0.99 TB/s
2       0.0839      0.1380      1.91 / 1.16 TB/s
4       0.1593      0.2485      2.01 / 1.13 TB/s
8       0.2858      0.4341      2.25 / 1.39 TB/s
======  ==========  ==========  ====================================

The first launches (four-warp programs of 32 and 16 rows) took 0.0801 ms at one token. Each slot's experts are
read once per slot, so the GEMV reads the bytes of ``T * k`` experts where the grouped kernels read each distinct
expert once: past some tens of tokens (or with many shared experts) the grouped path wins; 8 is the most measured."""


class GemvConfig(NamedTuple):
    """One GEMV kernel's launch: ``block_n`` output rows per program (a power of two), ``block_k`` inputs per K
    step (a power of two >= 32, whole scale groups), ``num_warps`` and ``num_stages``."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1

    def validate(self) -> None:
        if self.block_n < 1 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two, got {self.block_n}")
        if self.block_k < 32 or self.block_k & (self.block_k - 1):
            raise ValueError(f"block_k must be a power of two >= 32, got {self.block_k}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1) or self.num_stages < 1:
            raise ValueError(f"num_warps must be a power of two and num_stages >= 1, got {self}")


class DecodeGemvConfig(NamedTuple):
    """The two kernels' launches (``benchmarks/moe_kernel.py --decode-gemv --sweep`` times candidates), and how
    many splits the down launch shares a token's slots among (1: one program walks all ``k`` slots)."""

    gate_up: GemvConfig
    down: GemvConfig
    down_splits: int = 1

    def validate(self) -> None:
        self.gate_up.validate()
        self.down.validate()
        if self.down_splits < 1:
            raise ValueError(f"down_splits must be >= 1, got {self.down_splits}")


DECODE_GEMV_CONFIG = DecodeGemvConfig(GemvConfig(8, 512, 2, 1), GemvConfig(16, 512, 2, 1), 3)
"""Default launches, from ``benchmarks/moe_kernel.py --decode-gemv --sweep`` on the H200 at one token
(docs/perf.md, pass 9):

* gate/up: 6 x 2048 / 8 = 1536 two-warp programs of 8 rows (V4-Flash widths). Smaller programs, more of them, were
  faster: four-warp programs of 32 and 16 rows took 0.0801 ms for both kernels, two- and one-warp programs of 16
  and 8 rows 0.0532, these 0.0475. It steps more than ``256 * num_warps`` inputs, so its activation planes go
  through shared memory; with two warps that costs less than what the smaller programs gain.
* down: two-warp programs of 16 rows, a token's slots split over three programs whose last arrival adds the three
  sums. Both kernels together: 0.0463 ms at V4-Flash widths and 0.0648 at V4.1-Flash's (hidden 5120,
  intermediate 2304, 384 experts), against 0.0532 and 0.0740 for the best launches that walk all six slots in one
  program (a long chain of dependent steps with few bytes in flight). In the V4.1 slice's decode graph the down
  kernel took 106 us a step against 141 (68 against 74 in V4's). One
  launch serves both widths: 2304 is no whole number of 512-input steps, and the masked last step costs less than
  the best launch of whole steps gains (0.0635 for 256-input steps, six splits)."""

MIN_SLOTS_PER_SPLIT = 2
"""The fewest slots a split walks: with one slot a split (six splits of V4's six slots) the same launch was
slower than with two (0.0495 against 0.0463 ms at V4-Flash widths, 0.0668 against 0.0648 at V4.1-Flash's), the
partial sums' store and reduction no longer paid by a shorter chain. Steps of two slots (the tiny test models) run
unsplit."""

DOWN_SPLITS = envs.MOE_DOWN_SPLITS.get()
"""A number of splits of a token's slots for every down launch (``DSINFER_MOE_DOWN_SPLITS``), in place of the
configured launches' (measurement runs set it; unset, :func:`decode_gemv_config` decides)."""


def decode_gemv_config(inter: int) -> DecodeGemvConfig:
    """The launches for experts of intermediate size ``inter``: :data:`DECODE_GEMV_CONFIG` (every width the
    sweeps measured takes it; a masked last step serves widths of no whole steps), with :data:`DOWN_SPLITS` where
    set."""
    config = DECODE_GEMV_CONFIG
    if DOWN_SPLITS:
        config = config._replace(down_splits=int(DOWN_SPLITS))
    return config


def use_decode_gemv(x: torch.Tensor, weights: ExpertWeights, expert_ids: torch.Tensor) -> bool:
    """Whether ``routed_moe_triton`` takes the GEMV path: 1 .. DECODE_GEMV_MAX_TOKENS tokens, FP4 experts."""
    return weights.is_fp4 and 0 < expert_ids.shape[0] <= DECODE_GEMV_MAX_TOKENS and expert_ids.shape[1] > 0


if triton is not None:

    @triton.jit
    def _load_tile(w_rows, s_rows, row_ok, q0, K, GROUPS: tl.constexpr, EVEN: tl.constexpr):
        """One K step of one weight tile from word ``q0`` on: the code words ``[N, 4G]`` (each row's step
        contiguous: 16-byte loads, a warp's threads side by side along the row) and the scale bytes ``[N, G]``
        as int32. Past ``K`` (and for rows not ``row_ok``) nothing is read: zero codes, scale byte 127. ``EVEN``
        (every tile and step whole, the caller keeps ``q0`` inside ``K``): no masks, no predicated loads."""
        g = tl.arange(0, GROUPS)
        words = q0 + tl.arange(0, 4 * GROUPS)
        if EVEN:
            packed = tl.load(w_rows[:, None] + words[None, :])
            return packed, tl.load(s_rows[:, None] + (q0 // 4 + g)[None, :]).to(tl.int32)
        mask = row_ok[:, None] & (words // 4 < K // 32)[None, :]  # by scale group: constant over 16 bytes
        packed = tl.load(w_rows[:, None] + words[None, :], mask=mask, other=0)
        exponents = tl.load(
            s_rows[:, None] + (q0 // 4 + g)[None, :],
            mask=row_ok[:, None] & ((q0 // 4 + g) < K // 32)[None, :],
            other=127,
        )
        return packed, exponents.to(tl.int32)

    @triton.jit
    def _load_x(x_row, q0, K, GROUPS: tl.constexpr, EVEN: tl.constexpr):
        """The activations of one K step as eight ``[1, 4G]`` float32 tensors: tensor ``p`` holds input
        ``8q + p`` for each word ``q`` of the step (zeros past ``K``; ``EVEN``: unmasked, as in :func:`_load_tile`)."""
        words = q0 + tl.arange(0, 4 * GROUPS)
        ok = (words < K // 8) | EVEN
        inputs = x_row + 8 * words
        x0 = tl.load(inputs, mask=ok, other=0.0).to(tl.float32)
        x1 = tl.load(inputs + 1, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(inputs + 2, mask=ok, other=0.0).to(tl.float32)
        x3 = tl.load(inputs + 3, mask=ok, other=0.0).to(tl.float32)
        x4 = tl.load(inputs + 4, mask=ok, other=0.0).to(tl.float32)
        x5 = tl.load(inputs + 5, mask=ok, other=0.0).to(tl.float32)
        x6 = tl.load(inputs + 6, mask=ok, other=0.0).to(tl.float32)
        x7 = tl.load(inputs + 7, mask=ok, other=0.0).to(tl.float32)
        return x0[None], x1[None], x2[None], x3[None], x4[None], x5[None], x6[None], x7[None]

    @triton.jit
    def _f16_halves(halves, PTX: tl.constexpr):
        """The two float16 values of each int32 of ``halves`` (low half, high half) as float32. ``PTX``: one
        ``mov`` of the halves and two ``cvt.f32.f16`` (inline PTX), where Triton's int16 casts cost a shift and a
        byte permute a half."""
        if PTX:
            low, high = tl.inline_asm_elementwise(
                "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
                "=r,=r,r",
                [halves],
                dtype=(tl.float32, tl.float32),
                is_pure=True,
                pack=1,
            )
        else:
            low = halves.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            high = (halves >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return low, high

    @triton.jit
    def _accumulate(acc, packed, exponents, weight, x0, x1, x2, x3, x4, x5, x6, x7, PTX: tl.constexpr):
        """``acc [N, G]`` plus ``weight`` times one K step of one tile (``packed`` ``[N, 4G]`` words): each
        32-input group's ``sum(e2m1 * x)`` times its ue8m0 scale (``2**(byte - 127)``; byte 0 is the subnormal
        2**-127, 255 NaN).

        Codes ``p`` and ``p + 4`` of a word land in its low and high half-word as float16 bits: magnitude ``e1 e0
        m`` at bits 9..11 (float16's two lowest exponent bits and top mantissa bit), sign at bit 15; the constant
        ``-0x7FFF8000`` is the mask 0x80008000 as an int32 (:func:`_f16_halves` reads the two halves)."""
        scale = tl.where(exponents == 0, 0x00400000, exponents << 23)
        scale = tl.where(exponents == 255, 0x7FC00000, scale).to(tl.float32, bitcast=True)
        low, high = _f16_halves(((packed << 9) & 0x0E000E00) | ((packed << 12) & -0x7FFF8000), PTX)  # codes 0, 4
        part = low * x0
        part += high * x4
        low, high = _f16_halves(((packed << 5) & 0x0E000E00) | ((packed << 8) & -0x7FFF8000), PTX)  # codes 1, 5
        part += low * x1
        part += high * x5
        low, high = _f16_halves(((packed << 1) & 0x0E000E00) | ((packed << 4) & -0x7FFF8000), PTX)  # codes 2, 6
        part += low * x2
        part += high * x6
        low, high = _f16_halves(((packed >> 3) & 0x0E000E00) | (packed & -0x7FFF8000), PTX)  # codes 3, 7
        part += low * x3
        part += high * x7
        # 2**14 undoes the decode's 2**-14 exactly; scale * weight is exact (a power of two times the weight).
        groups = tl.sum(tl.reshape(part, (part.shape[0], part.shape[1] // 4, 4)), axis=2)  # a group: 4 words
        return acc + (groups * 16384.0) * (scale * weight)

    @triton.jit
    def _gate_up_gemv_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        ids_ptr,
        h_ptr,
        top_k,
        hidden,
        inter,
        num_experts,
        limit,
        x_row_stride,
        w_expert_stride,
        w_row_stride,
        s_expert_stride,
        s_row_stride,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN: tl.constexpr,
        PDL: tl.constexpr,
        PTX: tl.constexpr,  # inline PTX reads the decoded float16 pairs (compiled for NVIDIA, not interpreted)
    ):
        """``h[slot, n] = silu(min(x w1^T, limit)) * clamp(x w3^T, -limit, limit)`` for one slot and column tile.

        ``w_ptr``: the ``w13`` codes as int32 words ``[E, 2I, H/8]``; ``s_ptr``: the scale bytes ``[E, 2I, H/32]``.
        Each K step's loads are issued one step ahead (registers, no shared memory), so a program keeps two
        steps of weight bytes in flight while it decodes one. ``EVEN`` (``inter % BLOCK_N == 0`` and ``hidden %
        BLOCK_K == 0``): no masks; the look-ahead past the last step re-reads it, and a bad expert id reads
        expert 0 and stores zeros."""
        allow_dependents(PDL)
        GROUPS: tl.constexpr = BLOCK_K // 32
        WORDS: tl.constexpr = BLOCK_K // 8
        n_tile = tl.program_id(0)
        slot = tl.program_id(1)
        expert = tl.load(ids_ptr + slot)
        expert_ok = (expert >= 0) & (expert < num_experts)
        expert = tl.where(expert_ok, expert, 0)
        x_row = x_ptr + (slot // top_k).to(tl.int64) * x_row_stride
        columns = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = columns < tl.where(expert_ok, inter, 0)  # no rows of a bad expert id
        gate_words = w_ptr + expert * w_expert_stride + columns.to(tl.int64) * w_row_stride
        up_words = gate_words + inter * w_row_stride
        gate_scales = s_ptr + expert * s_expert_stride + columns.to(tl.int64) * s_row_stride
        up_scales = gate_scales + inter * s_row_stride
        gate = tl.zeros((BLOCK_N, GROUPS), tl.float32)
        up = tl.zeros((BLOCK_N, GROUPS), tl.float32)
        gate_next, gate_exp_next = _load_tile(gate_words, gate_scales, row_ok, 0, hidden, GROUPS, EVEN)
        up_next, up_exp_next = _load_tile(up_words, up_scales, row_ok, 0, hidden, GROUPS, EVEN)
        x0, x1, x2, x3, x4, x5, x6, x7 = _load_x(x_row, 0, hidden, GROUPS, EVEN)
        for q0 in range(0, hidden // 8, WORDS):  # the K step's first word
            gate_packed, gate_exp, up_packed, up_exp = gate_next, gate_exp_next, up_next, up_exp_next
            xs = (x0, x1, x2, x3, x4, x5, x6, x7)
            ahead = q0 + WORDS
            if EVEN:
                ahead = tl.minimum(ahead, hidden // 8 - WORDS)
            gate_next, gate_exp_next = _load_tile(gate_words, gate_scales, row_ok, ahead, hidden, GROUPS, EVEN)
            up_next, up_exp_next = _load_tile(up_words, up_scales, row_ok, ahead, hidden, GROUPS, EVEN)
            x0, x1, x2, x3, x4, x5, x6, x7 = _load_x(x_row, ahead, hidden, GROUPS, EVEN)
            gate = _accumulate(gate, gate_packed, gate_exp, 1.0, *xs, PTX)
            up = _accumulate(up, up_packed, up_exp, 1.0, *xs, PTX)
        # As the reference rounds: each F.linear output, the clamps, the SiLU and the product in x.dtype.
        dtype = h_ptr.dtype.element_ty
        gate = tl.sum(gate, axis=1).to(dtype).to(tl.float32)
        up = tl.sum(up, axis=1).to(dtype).to(tl.float32)
        gate = tl.minimum(gate, limit).to(dtype).to(tl.float32)
        up = tl.minimum(tl.maximum(up, -limit), limit).to(dtype).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        h = tl.where(expert_ok, activated * up, 0.0)
        tl.store(h_ptr + slot.to(tl.int64) * inter + columns, h.to(dtype), mask=columns < inter)

    @triton.jit
    def _down_step(h_ptr, w_ptr, s_ptr, ids_ptr, route_weight_ptr, token, choice, q0, top_k, stop, hidden, inter,
                   num_experts, columns, w_expert_stride, w_row_stride, s_expert_stride, s_row_stride,
                   GROUPS: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
        """The loads of the K step from word ``q0`` of the token's slot ``choice``: ``(words, scale bytes,
        routing weight, x0 .. x7)``. Past the program's last slot (``choice >= stop``) nothing is read (``EVEN``:
        the last slot's first step is read again, with a zero weight); a bad expert id's routing weight is zero."""
        if EVEN:
            q0 = tl.where(choice < stop, q0, 0)
        slot = token * top_k + tl.minimum(choice, stop - 1)
        expert = tl.load(ids_ptr + slot)
        expert_ok = (expert >= 0) & (expert < num_experts) & (choice < stop)
        expert = tl.where(expert_ok, expert, 0)
        route_weight = tl.where(expert_ok, tl.load(route_weight_ptr + slot), 0.0)
        row_ok = columns < tl.where(expert_ok, hidden, 0)
        w_rows = w_ptr + expert * w_expert_stride + columns.to(tl.int64) * w_row_stride
        s_rows = s_ptr + expert * s_expert_stride + columns.to(tl.int64) * s_row_stride
        packed, exponents = _load_tile(w_rows, s_rows, row_ok, q0, inter, GROUPS, EVEN)
        h_row = h_ptr + slot * inter
        x0, x1, x2, x3, x4, x5, x6, x7 = _load_x(h_row, q0, tl.where(choice < stop, inter, 0), GROUPS, EVEN)
        return packed, exponents, route_weight, x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def _down_gemv_kernel(
        h_ptr,
        w_ptr,
        s_ptr,
        ids_ptr,
        route_weight_ptr,
        out_ptr,
        partial_ptr,
        arrived_ptr,
        top_k,
        slots_per_split,
        hidden,
        inter,
        num_experts,
        w_expert_stride,
        w_row_stride,
        s_expert_stride,
        s_row_stride,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN: tl.constexpr,
        SPLIT: tl.constexpr,
        PDL: tl.constexpr,
        PTX: tl.constexpr,  # inline PTX reads the decoded float16 pairs (compiled for NVIDIA, not interpreted)
    ):
        """``out[token, n] = sum over the token's slots of route_weight * (h[slot] w2^T)[n]``.

        ``w_ptr``: the ``w2`` codes as int32 words ``[E, H, I/8]``; ``s_ptr``: the scale bytes ``[E, H, I/32]``.
        One flat loop over (slot, K step) of the program's ``slots_per_split`` slots (program id 2 is the split),
        slots in order, each step's loads issued one step ahead: the next slot's first bytes are in flight while
        the last step of a slot is decoded. ``EVEN``: ``hidden % BLOCK_N == 0`` and ``inter % BLOCK_K == 0``, no
        masks.

        ``SPLIT``: each split stores its float32 sum in ``partial_ptr`` ``[splits, tokens, H]``; the last split of
        a (token, tile) to arrive (``arrived_ptr``, one count a tile, zero between launches) adds the splits in
        split order, stores the row tile and sets the count back."""
        allow_dependents(PDL)
        GROUPS: tl.constexpr = BLOCK_K // 32
        n_tile = tl.program_id(0)
        token = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        columns = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        WORDS: tl.constexpr = BLOCK_K // 8
        choice = split * slots_per_split  # the slot of the step loaded ahead; counted, not divided out of an index
        stop = tl.minimum(choice + slots_per_split, top_k)
        strides = (w_expert_stride, w_row_stride, s_expert_stride, s_row_stride)
        common = (h_ptr, w_ptr, s_ptr, ids_ptr, route_weight_ptr, token)
        sizes = (top_k, stop, hidden, inter, num_experts, columns)
        acc = tl.zeros((BLOCK_N, GROUPS), tl.float32)
        q0 = 0
        loads = _down_step(*common, choice, q0, *sizes, *strides, GROUPS, EVEN)
        for _ in range(0, slots_per_split * tl.cdiv(inter, BLOCK_K)):  # the same count in every program
            packed, exponents, weight, x0, x1, x2, x3, x4, x5, x6, x7 = loads
            q0 += WORDS
            next_slot = q0 >= inter // 8
            choice += next_slot.to(tl.int32)
            q0 = tl.where(next_slot, 0, q0)
            loads = _down_step(*common, choice, q0, *sizes, *strides, GROUPS, EVEN)
            acc = _accumulate(acc, packed, exponents, weight, x0, x1, x2, x3, x4, x5, x6, x7, PTX)
        out = tl.sum(acc, axis=1)
        row = out_ptr + token * hidden + columns
        if SPLIT:
            splits = tl.num_programs(2)
            tokens = tl.num_programs(1)
            tile = token * tl.num_programs(0) + n_tile
            tl.store(partial_ptr + (split * tokens + token) * hidden + columns, out, mask=columns < hidden)
            tl.debug_barrier()  # every thread's partial is written before the count says so
            if tl.atomic_add(arrived_ptr + tile, 1) == splits - 1:
                total = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for earlier in range(0, splits):
                    at = partial_ptr + (earlier * tokens + token) * hidden + columns
                    total += tl.load(at, mask=columns < hidden, other=0.0, cache_modifier=".cg")
                tl.store(row, total.to(out_ptr.dtype.element_ty), mask=columns < hidden)
                tl.atomic_xchg(arrived_ptr + tile, 0)
        else:
            tl.store(row, out.to(out_ptr.dtype.element_ty), mask=columns < hidden)


def routed_moe_decode_gemv(
    x: torch.Tensor,
    weights: ExpertWeights,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    swiglu_limit: float,
    *,
    config: DecodeGemvConfig | None = None,
) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` in ``x.dtype`` through the two GEMV kernels (FP4 experts only;
    bf16 or fp32 activations). Meant for ``T <= DECODE_GEMV_MAX_TOKENS`` but correct at any ``T``.

    Allocates ``[T*k, I]`` scratch in ``x.dtype``; never reads a device value on the host."""
    if triton is None:
        raise RuntimeError("the GEMV routed_moe path needs Triton installed")
    check_inputs(x, weights, expert_ids, expert_weights)
    if not weights.is_fp4:
        raise ValueError("the GEMV routed_moe path takes packed FP4 experts only")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the GEMV routed_moe path takes bf16 or fp32 activations, got {x.dtype}")
    config = decode_gemv_config(weights.intermediate_size) if config is None else config
    config.validate()
    tokens, top_k = expert_ids.shape
    hidden, inter = weights.hidden_size, weights.intermediate_size
    if tokens * top_k == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    ids = expert_ids.contiguous()
    route_weight = expert_weights.reshape(-1).contiguous()
    w13 = weights.w13.view(torch.int32)  # [E, 2I, H/8]: eight codes a word (hidden is a multiple of 32)
    w2 = weights.w2.view(torch.int32)  # [E, H, I/8]
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = config.gate_up
    _gate_up_gemv_kernel[(triton.cdiv(inter, block_n), tokens * top_k)](
        x, w13, weights.w13_scale, ids, h, top_k, hidden, inter, weights.num_experts, float(swiglu_limit),
        x.stride(0), w13.stride(0), w13.stride(1), weights.w13_scale.stride(0), weights.w13_scale.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN=inter % block_n == 0 and hidden % block_k == 0,
        PDL=dependent_launch(x.device), PTX=inline_ptx_available(x.device),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    block_n, block_k, num_warps, num_stages = config.down
    tiles = triton.cdiv(hidden, block_n)
    slots_per_split, splits, arrived, partial = _plan_down_splits(config.down_splits, top_k, tokens, tiles, out)
    _down_gemv_kernel[(tiles, tokens, splits)](
        h, w2, weights.w2_scale, ids, route_weight, out, partial, arrived, top_k, slots_per_split, hidden, inter,
        weights.num_experts, w2.stride(0), w2.stride(1), weights.w2_scale.stride(0), weights.w2_scale.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN=hidden % block_n == 0 and inter % block_k == 0, SPLIT=splits > 1,
        PDL=dependent_launch(x.device), PTX=inline_ptx_available(x.device),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def _plan_down_splits(
    wanted: int, top_k: int, tokens: int, tiles: int, out: torch.Tensor
) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """The down launch's slots per split, splits, tile counts and float32 partials ``[splits, tokens, H]`` for
    ``wanted`` splits of ``top_k`` slots: as many whole slots per split as that asks but at least
    :data:`MIN_SLOTS_PER_SPLIT`, the last split shorter where they do not divide (its missing steps read nothing
    new, with a zero weight). Unsplit where no counts can be had (:func:`dsinfer.ops.split_arrivals.arrival_counts`)."""
    per_split = max(MIN_SLOTS_PER_SPLIT, -(-top_k // max(1, min(wanted, top_k))))
    splits = -(-top_k // per_split)
    arrived = arrival_counts(out.device, tiles * tokens) if splits > 1 else None
    if arrived is None:
        return top_k, 1, out, out  # not read unsplit
    partial = torch.empty(splits, *out.shape, dtype=torch.float32, device=out.device)
    return per_split, splits, arrived, partial
