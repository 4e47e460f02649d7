"""Hand-checked small cases: V4.1's trained-in fake quantizers and the candidate-block mask.

Every expected value below is worked out by hand from the written rules (the e4m3 / e2m1 grids, the
power-of-two scale ceiling, round-to-nearest-even), not by calling the code under test.
"""

from __future__ import annotations

import struct

import pytest
import torch

from dsinfer.layers.csa2 import select_candidate_blocks
from dsinfer.layers.indexer import top_k_visible
from dsinfer.ops.fake_quant import (
    fake_quant_compressed_kv,
    fake_quant_fp4,
    fake_quant_fp8,
    fake_quant_index,
    fake_quant_window_kv,
    pow2_ceil,
)

INF = float("inf")


def _f32(x: float) -> float:
    """Round a Python float to float32 (independent of torch)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _block(values: list[float], width: int) -> torch.Tensor:
    """One block of ``width`` channels starting with ``values``, zero elsewhere."""
    out = torch.zeros(width)
    out[: len(values)] = torch.tensor(values)
    return out


# ------------------------------------------------------------------------------- the scale ceiling
def test_pow2_ceil_reads_the_ieee_fields():
    # exact powers of two stay; anything with a mantissa bit goes up; subnormals give 2**-127 / 2**-126
    # 2**-127 is subnormal (exponent field 0, mantissa 0x400000): -127 + 1 -> 2**-126; only 0 gives 2**-127
    t = torch.tensor([1.0, 0.5, 1.0000001, 3.0, 448.0, 2.0**-126, 2.0**-127, 2.0**-130, 1e-45, 0.0])
    want = torch.tensor([1.0, 0.5, 2.0, 4.0, 512.0, 2.0**-126, 2.0**-126, 2.0**-126, 2.0**-126, 2.0**-127])
    assert torch.equal(pow2_ceil(t), want)


# ------------------------------------------------------------------------------- FP8 window KV
def test_fp8_zeros_stay_zero():
    assert torch.equal(fake_quant_window_kv(torch.zeros(2, 64)), torch.zeros(2, 64))


def test_fp8_amax_448_has_unit_scale_and_rounds_ties_to_even():
    # 448 * fl32(1/448) rounds to exactly 1.0 in float32, so the ue8m0 scale is 2**0.
    assert _f32(448.0 * _f32(1 / 448)) == 1.0
    # e4m3 near 1 has step 1/8: 1.0625 is a tie between 1 (even) and 1.125 -> 1; 1.1875 ties 1.125 / 1.25 -> 1.25.
    # Near 100 the step is 8: 100 ties 96 / 104 -> 96 (mantissa 100b even); 3.3 -> 3.25 (step 0.25).
    x = _block([448.0, 1.0625, 1.1875, 100.0, 3.3, -0.0009, 0.0011], 32)
    want = _block([448.0, 1.0, 1.25, 96.0, 3.25, 0.0, 2.0**-9], 32)  # 0.0011 > 2**-10: nearest subnormal 2**-9
    assert torch.equal(fake_quant_fp8(x, 32), want)


def test_fp8_amax_just_above_a_power_of_two_doubles_the_scale():
    # 449 / 448 > 1 so the scale is 2; 449 / 2 = 224.5, e4m3 step at 224 is 16 -> 224 -> 448. 3 / 2 = 1.5 exact.
    x = _block([449.0, 3.0, 1.0], 32)
    want = _block([448.0, 3.0, 1.0], 32)
    assert torch.equal(fake_quant_fp8(x, 32), want)


def test_fp8_small_blocks_use_the_1e4_floor():
    # amax 1e-6 < 1e-4: scale 2**ceil(log2(1e-4 / 448)) = 2**-22. 1e-6 * 2**22 = 4.194 -> e4m3 4.0 (step 0.5).
    x = _block([1e-6, -1e-6], 32)
    want = _block([4.0 * 2.0**-22, -4.0 * 2.0**-22], 32)
    assert torch.equal(fake_quant_fp8(x, 32), want)


def test_fp8_blocks_are_independent_and_odd_widths_pass_through():
    x = torch.cat([_block([448.0, 1.125, 1.0625], 32), _block([2.0, 1.125, 1.0625], 32)])
    # second block: amax 2 -> scale 2**ceil(log2(2/448)) = 2**-7; 1.125 * 128 = 144 is on the grid (step 16
    # there); 1.0625 * 128 = 136 ties 128 / 144 -> 128 (even), the same as 1.0625 with scale 1.
    want = torch.cat([_block([448.0, 1.125, 1.0], 32), _block([2.0, 1.125, 1.0], 32)])
    assert torch.equal(fake_quant_fp8(x, 32), want)
    odd = torch.randn(3, 40)
    assert torch.equal(fake_quant_fp8(odd, 32), odd)


# ------------------------------------------------------------------------------- FP4 indexer (ue8m0)
def test_fp4_ue8m0_ties_go_to_the_even_code():
    assert _f32(6.0 * _f32(1 / 6)) == 1.0  # so amax 6 gives scale 1
    values = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 2.6, -4.4]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 3.0, -4.0]
    assert torch.equal(fake_quant_index(_block(values, 32)), _block(want, 32))


def test_fp4_ue8m0_scale_rounds_up():
    # amax 7: 7/6 > 1 -> scale 2. 7/2 = 3.5 ties 3 (code 5) / 4 (code 6, even) -> 4 -> 8;
    # 1/2 = 0.5 exact -> 1.0; -2.9/2 = -1.45 -> -1.5 (midpoint 1.25 below) -> -3.0
    x = _block([7.0, 1.0, -2.9], 32)
    want = _block([8.0, 1.0, -3.0], 32)
    assert torch.equal(fake_quant_index(x), want)


def test_fp4_tiny_blocks_hit_the_ue8m0_floor():
    # amax floor 6 * 2**-126 -> scale 2**-126: 1e-38 * 2**126 = 0.85 -> e2m1 1.0 -> 2**-126
    x = _block([1e-38], 32)
    assert torch.equal(fake_quant_index(x), _block([2.0**-126], 32))


# ------------------------------------------------------------------------------- FP4 compressed KV (e4m3 scales)
def test_fp4_e4m3_scale_saturates_at_6_codes():
    # amax 7: 7/6 = 1.1667 -> e4m3 grid 1.125 / 1.25 -> 1.125 (nearer). 7 / 1.125 = 6.22 -> clamp 6 -> 6.75.
    # 1.0 / 1.125 = 0.889 -> 1.0 -> 1.125; -2.3 / 1.125 = -2.04 -> -2.0 -> -2.25
    x = _block([7.0, 1.0, -2.3], 16)
    assert torch.equal(fake_quant_compressed_kv(x), _block([6.75, 1.125, -2.25], 16))


def test_fp4_e4m3_subnormal_scales():
    # amax 6 * 2**-8: scale e4m3(2**-8) = 2**-8 (an e4m3 subnormal), values exact.
    x = _block([6 * 2.0**-8, -3 * 2.0**-8, 0.5 * 2.0**-8], 16)
    assert torch.equal(fake_quant_compressed_kv(x), x)
    # amax 1e-5 is under the floor 6 * 2**-9: scale 2**-9 (smallest e4m3 subnormal); 1e-5 / 2**-9 = 0.005 -> 0
    tiny = _block([1e-5, -1e-5], 16)
    assert torch.equal(fake_quant_compressed_kv(tiny), torch.zeros(16))
    # two blocks of 16 with different scales
    x = torch.cat([_block([6.0, 1.3], 16), _block([3.0, 1.3], 16)])
    # block 1: scale 1 -> 1.3 -> 1.5; block 2: scale e4m3(0.5) = 0.5 -> 1.3/0.5 = 2.6 -> 3 -> 1.5
    assert torch.equal(
        fake_quant_fp4(x, 16, e4m3_scales=True), torch.cat([_block([6.0, 1.5], 16), _block([3.0, 1.5], 16)])
    )


def test_fake_quant_keeps_dtype_and_shape():
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    for fn in (fake_quant_window_kv, fake_quant_compressed_kv, fake_quant_index):
        out = fn(x)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        assert torch.equal(fn(out), out)  # idempotent: grid values stay on the grid


# ------------------------------------------------------------------------------- candidate blocks
def test_candidate_mask_on_a_crafted_pattern():
    scores = torch.tensor(
        [
            # 14 visible entries, blocks of 4: maxima b0 = 5, b1 = 1, b2 = 3, b3 (newest, partial) = -2
            [5.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 3.0, 0.0, 0.0, 0.0, -2.0, -3.0],
            # 6 visible: newest block is b1 (entries 4, 5); the best other block is b0
            [0.0, 0.5, 0.0, 0.0, -9.0, -8.0, -INF, -INF, -INF, -INF, -INF, -INF, -INF, -INF],
            # nothing visible yet: no block at all
            [-INF] * 14,
            # 3 visible, all in b0, which is also the newest: only b0 (the second pick would be -inf)
            [1.0, 2.0, 3.0] + [-INF] * 11,
        ]
    )
    counts = torch.tensor([14, 6, 0, 3])
    mask = select_candidate_blocks(scores, counts, topk_blocks=2, block_size=4)
    want = torch.zeros(4, 14, dtype=torch.bool)
    want[0, 0:4] = want[0, 12:14] = True  # b0 (best) + b3 (newest, pinned although worst)
    want[1, 0:8] = True  # b0 + b1 (pinned); entries 6, 7 are in the mask but invisible (scores -inf)
    want[3, 0:4] = True
    assert torch.equal(mask, want)


def test_candidate_mask_keeps_the_best_blocks_when_the_newest_is_also_best():
    scores = torch.tensor([[0.0, 1.0, 9.0, 2.0, 0.0, 7.0, 3.0]])  # blocks of 2: maxima 1, 9, 7, 3 (newest)
    mask = select_candidate_blocks(scores, torch.tensor([7]), topk_blocks=3, block_size=2)
    assert mask.tolist() == [[False, False, True, True, True, True, True]]


def test_top_k_drops_invisible_picks():
    scores = torch.tensor([[0.5, -INF, 2.0, 1.0], [-INF, -INF, -INF, -INF], [3.0, -INF, -INF, -INF]])
    assert top_k_visible(scores, 2).tolist() == [
        [False, False, True, True],
        [False, False, False, False],
        [True, False, False, False],
    ]


@pytest.mark.parametrize("block_size", [1, 3, 8])
def test_candidate_mask_selects_whole_blocks(block_size):
    gen = torch.Generator().manual_seed(block_size)
    scores = torch.randn(5, 30, generator=gen)
    counts = torch.tensor([30, 29, 17, 9, 1])
    scores = scores.masked_fill(torch.arange(30) >= counts[:, None], -INF)
    mask = select_candidate_blocks(scores, counts, topk_blocks=3, block_size=block_size)
    for row, count in zip(mask, counts.tolist(), strict=True):
        blocks = row.view(-1, block_size).any(-1) if 30 % block_size == 0 else None
        if blocks is not None:
            assert torch.equal(row.view(-1, block_size).all(-1), blocks)  # whole blocks only
            assert int(blocks.sum()) == min(3, -(-count // block_size))
        assert bool(row[(count - 1)]), "the newest visible entry is always a candidate"
