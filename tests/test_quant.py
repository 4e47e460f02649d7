"""Tests for the checkpoint quantisation formats in dsinfer.ops.quant."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsinfer.ops.quant import (
    E2M1_VALUES,
    FP4_MAX,
    FP8_MAX,
    dequantize_fp4,
    dequantize_fp8_blockwise,
    pack_e2m1_codes,
    quantize_fp4,
    quantize_fp8_blockwise,
    round_to_e2m1_codes,
    ue8m0_scale,
    unpack_e2m1_codes,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _e4m3_grid() -> torch.Tensor:
    """Every finite float8_e4m3fn value."""
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
    return codes[torch.isfinite(codes)]


def _pow2(exponents: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones(exponents.shape), exponents.to(torch.int32))


# --------------------------------------------------------------------------------------------
# ue8m0_scale
# --------------------------------------------------------------------------------------------


def test_ue8m0_scale_is_ceil_power_of_two() -> None:
    amax = torch.tensor([448.0, 449.0, 447.0, 224.0, 1.0, 896.0, 448.0 * 2**-20, 3.0])
    expected = torch.tensor([1.0, 2.0, 1.0, 0.5, 2.0**-8, 2.0, 2.0**-20, 2.0**-7])
    torch.testing.assert_close(ue8m0_scale(amax), expected, rtol=0, atol=0)


def test_ue8m0_scale_never_saturates_and_is_tight() -> None:
    amax = torch.rand(10_000, dtype=torch.float64).float() * 1000 + 1e-6
    scale = ue8m0_scale(amax)
    assert bool((amax / scale <= FP8_MAX).all())
    assert bool((amax / scale > FP8_MAX / 2).all())  # the next smaller power of two would overflow
    mantissa, _ = torch.frexp(scale)
    assert bool((mantissa == 0.5).all())


def test_ue8m0_scale_zero_and_extremes() -> None:
    scale = ue8m0_scale(torch.tensor([0.0, 1e-38, 3e38]), max_value=2.0**-10)
    assert scale[0].item() == 2.0**-127
    assert scale[1].item() == 2.0**-116  # 1e-38 * 2**10 ~ 2**-116.2, rounded up
    assert scale[2].item() == 2.0**127  # ratio overflows float32 -> largest ue8m0 value
    assert ue8m0_scale(torch.tensor([1e-38]))[0].item() == 2.0**-127  # clamped to the smallest ue8m0 value
    # all three survive the trip through the storage dtype unchanged
    assert torch.equal(scale.to(torch.float8_e8m0fnu).float(), scale)


def test_ue8m0_scale_fp4_range() -> None:
    amax = torch.tensor([6.0, 6.5, 3.0, 12.0, 0.75])
    expected = torch.tensor([1.0, 2.0, 0.5, 2.0, 0.125])
    torch.testing.assert_close(ue8m0_scale(amax, FP4_MAX), expected, rtol=0, atol=0)


def test_ue8m0_scale_rejects_integer_input() -> None:
    with pytest.raises(ValueError, match="floating"):
        ue8m0_scale(torch.tensor([1, 2]))


# --------------------------------------------------------------------------------------------
# FP8 block-wise
# --------------------------------------------------------------------------------------------


def _fp8_grid_weight(rows: int, cols: int, block: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """A weight whose every block is e4m3 grid values (including 448) times a power of two."""
    gen = torch.Generator().manual_seed(seed)
    grid = _e4m3_grid()
    idx = torch.randint(0, grid.numel(), (rows, cols), generator=gen)
    values = grid[idx]
    n_rb, n_cb = -(-rows // block[0]), -(-cols // block[1])
    exps = torch.randint(-30, 10, (n_rb, n_cb), generator=gen)
    scales = _pow2(exps)
    # Put a +-448 in every block so the block max pins the scale to exactly `scales`.
    for i in range(n_rb):
        for j in range(n_cb):
            values[i * block[0], j * block[1]] = FP8_MAX if (i + j) % 2 == 0 else -FP8_MAX
    full = scales.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return values * full, scales


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("rows", "cols", "block"),
    [(256, 384, (128, 128)), (200, 300, (128, 128)), (5, 7, (2, 3)), (130, 1, (128, 128))],
)
def test_fp8_exact_round_trip_on_grid(device: str, rows: int, cols: int, block: tuple[int, int]) -> None:
    weight, scales = _fp8_grid_weight(rows, cols, block)
    weight = weight.to(device)
    q, s = quantize_fp8_blockwise(weight, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (rows, cols)
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (-(-rows // block[0]), -(-cols // block[1]))
    assert torch.equal(s.float().cpu(), scales)
    back = dequantize_fp8_blockwise(q, s, block)
    assert back.dtype == torch.float32
    assert torch.equal(back, weight)


def test_fp8_scale_shapes_of_checkpoint_tensors() -> None:
    # wq_a [1024, 4096] -> [8, 32]; wkv [512, 4096] -> [4, 32]; wo_a [8192, 4096] -> [64, 32]
    for shape, scale_shape in [((1024, 4096), (8, 32)), ((512, 4096), (4, 32)), ((256, 8192), (2, 64))]:
        _, s = quantize_fp8_blockwise(torch.randn(shape))
        assert tuple(s.shape) == scale_shape


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_random_error_bound(device: str) -> None:
    torch.manual_seed(0)
    weight = (torch.randn(300, 520) * torch.logspace(-3, 1, 520)).to(device)
    q, s = quantize_fp8_blockwise(weight)
    back = dequantize_fp8_blockwise(q, s)
    # Each element: |err| <= half an e4m3 ulp, i.e. 2**-4 relative for normals, and at most
    # 2**-10 * scale absolute in the subnormal range.
    scale_full = s.float().repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :520]
    bound = torch.maximum(weight.abs() * 2.0**-4, scale_full * 2.0**-10)
    assert bool(((back - weight).abs() <= bound).all())
    rel = (back - weight).norm() / weight.norm()
    assert rel < 0.03


def test_fp8_partial_edge_blocks_use_their_own_max() -> None:
    weight = torch.zeros(130, 260)
    weight[:128, :128] = 1000.0  # full block
    weight[128:, :128] = 3.0  # bottom edge block: 2 rows
    weight[:128, 256:] = 0.01  # right edge block: 4 cols
    weight[128:, 256:] = -7.0  # corner block: 2x4
    q, s = quantize_fp8_blockwise(weight)
    assert s.shape == (2, 3)
    expected = ue8m0_scale(torch.tensor([[1000.0, 0.0, 0.01], [3.0, 0.0, 7.0]]))
    assert torch.equal(s.float(), expected)
    assert torch.equal(dequantize_fp8_blockwise(q, s)[128:, 256:], torch.full((2, 4), -7.0))


def test_fp8_batched_leading_dims() -> None:
    torch.manual_seed(1)
    weight = torch.randn(3, 256, 128)
    q, s = quantize_fp8_blockwise(weight)
    assert q.shape == (3, 256, 128) and s.shape == (3, 2, 1)
    for i in range(3):
        q_i, s_i = quantize_fp8_blockwise(weight[i])
        assert torch.equal(q[i].view(torch.uint8), q_i.view(torch.uint8))
        assert torch.equal(s[i].view(torch.uint8), s_i.view(torch.uint8))


def test_fp8_bf16_input_and_output_dtype() -> None:
    weight, _ = _fp8_grid_weight(128, 256, (128, 128))
    weight = weight.clamp(-1e4, 1e4)
    bf = weight.bfloat16()
    q, s = quantize_fp8_blockwise(bf)
    back = dequantize_fp8_blockwise(q, s, dtype=torch.bfloat16)
    assert back.dtype == torch.bfloat16
    torch.testing.assert_close(back.float(), bf.float(), rtol=2**-3, atol=0)


def test_fp8_float32_scales() -> None:
    weight, scales = _fp8_grid_weight(256, 256, (128, 128))
    q, s = quantize_fp8_blockwise(weight, scale_dtype=torch.float32)
    assert s.dtype == torch.float32 and torch.equal(s, scales)
    assert torch.equal(dequantize_fp8_blockwise(q, s), weight)


def test_fp8_zero_block() -> None:
    q, s = quantize_fp8_blockwise(torch.zeros(128, 128))
    assert s.view(torch.uint8).item() == 0  # 2**-127
    assert torch.equal(dequantize_fp8_blockwise(q, s), torch.zeros(128, 128))


def test_fp8_quantize_errors() -> None:
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_fp8_blockwise(torch.randn(128))
    with pytest.raises(ValueError, match="dtype"):
        quantize_fp8_blockwise(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="block"):
        quantize_fp8_blockwise(torch.randn(4, 4), (0, 128))
    with pytest.raises(ValueError, match="scale_dtype"):
        quantize_fp8_blockwise(torch.randn(4, 4), scale_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_fp8_blockwise(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="empty"):
        quantize_fp8_blockwise(torch.zeros(0, 4))


def test_fp8_dequantize_errors() -> None:
    q, s = quantize_fp8_blockwise(torch.randn(256, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8_blockwise(q.float(), s)
    with pytest.raises(ValueError, match=r"expected \(2, 1\)"):
        dequantize_fp8_blockwise(q, s[:1])
    with pytest.raises(ValueError, match="scale must be"):
        dequantize_fp8_blockwise(q, s.view(torch.uint8))
    with pytest.raises(ValueError, match="at least 2 dims"):
        dequantize_fp8_blockwise(q[0], s)


# --------------------------------------------------------------------------------------------
# FP4 e2m1
# --------------------------------------------------------------------------------------------


def test_e2m1_code_table() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    values = torch.tensor(E2M1_VALUES)
    assert torch.equal(round_to_e2m1_codes(values), codes)
    # every code decodes back to its table value, signed zero included
    decoded = dequantize_fp4(pack_e2m1_codes(codes), torch.ones(1), group=16)
    assert torch.equal(decoded, values)
    assert torch.equal(torch.signbit(decoded), torch.signbit(values))


def test_e2m1_rounding_ties_to_even_and_saturation() -> None:
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 5.01, 7.0, 100.0, -0.1, -2.6])
    expected_values = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 6.0, 6.0, 6.0, -0.0, -3.0])
    codes = round_to_e2m1_codes(x)
    got = torch.tensor(E2M1_VALUES)[codes.long()]
    assert torch.equal(got, expected_values)
    assert codes[12].item() == 8  # -0.1 keeps its sign: -0.0


def test_pack_nibble_order_hand_computed() -> None:
    # element 0 -> low nibble, element 1 -> high nibble
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x0, 0x7, 0x9]], dtype=torch.uint8)
    packed = pack_e2m1_codes(codes)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x0F, 0x97]]
    assert torch.equal(unpack_e2m1_codes(packed), codes)


def test_fp4_hand_computed_weight() -> None:
    # 32 values in one group: amax 12 -> scale 2 (12/6 = 2 exactly a power of two)
    row = torch.zeros(32)
    # divided by the scale: 0.5 -> code 1, -6 -> code 15, 1.5 -> code 3, 0.25 -> code 0 (tie to even)
    row[0], row[1], row[2], row[3] = 1.0, -12.0, 3.0, 0.5
    packed, scale = quantize_fp4(row[None])
    assert scale.dtype == torch.float8_e8m0fnu and scale.float().tolist() == [[2.0]]
    assert packed.shape == (1, 16)
    assert packed.view(torch.uint8)[0, :2].tolist() == [0x1 | (0xF << 4), 0x3 | (0x0 << 4)]
    back = dequantize_fp4(packed, scale)
    assert back[0, :4].tolist() == [1.0, -12.0, 3.0, 0.0]


@pytest.mark.parametrize("device", DEVICES)
def test_fp4_exact_round_trip_on_grid(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    out, inp = 64, 256
    values = torch.tensor(E2M1_VALUES)[torch.randint(0, 16, (out, inp), generator=gen)]
    values[:, ::32] = 6.0  # pin every group's max so the scale is exactly the chosen one
    scales = _pow2(torch.randint(-40, 20, (out, inp // 32), generator=gen))
    weight = (values * scales.repeat_interleave(32, 1)).to(device)
    packed, scale = quantize_fp4(weight)
    assert packed.dtype == torch.int8 and packed.shape == (out, inp // 2)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (out, inp // 32)
    assert torch.equal(scale.float().cpu(), scales)
    back = dequantize_fp4(packed, scale)
    assert torch.equal(back, weight)


@pytest.mark.parametrize("device", DEVICES)
def test_fp4_random_error_bound(device: str) -> None:
    torch.manual_seed(0)
    weight = (torch.randn(128, 512) * torch.logspace(-2, 1, 512)).to(device)
    packed, scale = quantize_fp4(weight)
    back = dequantize_fp4(packed, scale)
    # Nearest rounding on the e2m1 grid: the gap between neighbours is at most 2 (between
    # 4 and 6), so the error is at most 1 * scale, and at most 0.25 * scale below 2 * scale.
    s = scale.float().repeat_interleave(32, 1)
    err = (back - weight).abs()
    assert bool((err <= s).all())
    small = weight.abs() < 2 * s
    assert bool((err[small] <= 0.25 * s[small]).all())
    # ...and it is the nearest representable value: no grid point is strictly closer.
    grid = torch.tensor(E2M1_VALUES, device=device)
    dist = ((weight / s)[..., None] - grid).abs().amin(-1) * s
    assert torch.allclose(err, dist, rtol=0, atol=0)


def test_fp4_matches_checkpoint_dequant_convention() -> None:
    # Decode the way the official convert.py does (low nibble first, FP4 table, scale per 32).
    gen = torch.Generator().manual_seed(3)
    packed = torch.randint(-128, 128, (4, 64), dtype=torch.int8, generator=gen)
    scale = _pow2(torch.randint(-5, 5, (4, 4), generator=gen)).to(torch.float8_e8m0fnu)
    table = torch.tensor(E2M1_VALUES)
    raw = packed.view(torch.uint8)
    ref = torch.stack([table[(raw & 0x0F).long()], table[(raw >> 4).long()]], dim=-1).flatten(1)
    ref = ref * scale.float().repeat_interleave(32, 1)
    assert torch.equal(dequantize_fp4(packed, scale), ref)
    # and re-quantising the decoded weight reproduces the same bytes up to -0.0 vs 0.0
    packed2, scale2 = quantize_fp4(ref)
    assert torch.equal(dequantize_fp4(packed2, scale2), ref)


def test_fp4_float4_e2m1fn_x2_view_is_accepted() -> None:
    packed, scale = quantize_fp4(torch.randn(8, 64))
    as_x2 = packed.view(torch.float4_e2m1fn_x2)
    assert torch.equal(dequantize_fp4(as_x2, scale), dequantize_fp4(packed, scale))


def test_fp4_batched_and_dtype() -> None:
    torch.manual_seed(2)
    weight = torch.randn(2, 3, 64)
    packed, scale = quantize_fp4(weight, scale_dtype=torch.float32)
    assert packed.shape == (2, 3, 32) and scale.shape == (2, 3, 2) and scale.dtype == torch.float32
    out = dequantize_fp4(packed, scale, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 64)


def test_fp4_errors() -> None:
    with pytest.raises(ValueError, match="multiple of group"):
        quantize_fp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="group"):
        quantize_fp4(torch.randn(4, 64), group=3)
    with pytest.raises(ValueError, match="dtype"):
        quantize_fp4(torch.ones(4, 64, dtype=torch.int64))
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_fp4(torch.full((1, 32), float("nan")))
    packed, scale = quantize_fp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="packed must be"):
        dequantize_fp4(packed.float(), scale)
    with pytest.raises(ValueError, match=r"expected \(4, 2\)"):
        dequantize_fp4(packed, scale[:, :1])
    with pytest.raises(ValueError, match="scale must be"):
        dequantize_fp4(packed, scale.view(torch.uint8))
    with pytest.raises(ValueError, match="even"):
        pack_e2m1_codes(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_e2m1_codes(torch.full((2,), 16, dtype=torch.uint8))


# --------------------------------------------------------------------------------------------
# safetensors storage
# --------------------------------------------------------------------------------------------


def test_safetensors_round_trip_of_checkpoint_dtypes(tmp_path) -> None:
    torch.manual_seed(0)
    q8, s8 = quantize_fp8_blockwise(torch.randn(256, 200))
    q4, s4 = quantize_fp4(torch.randn(64, 128))
    tensors = {
        "layers.0.attn.wq_a.weight": q8,
        "layers.0.attn.wq_a.scale": s8,
        "layers.0.ffn.experts.0.w1.weight": q4,
        "layers.0.ffn.experts.0.w1.scale": s4,
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))

    with safe_open(str(path), framework="pt") as f:
        header_dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert header_dtypes == {
        "layers.0.attn.wq_a.weight": "F8_E4M3",
        "layers.0.attn.wq_a.scale": "F8_E8M0",
        "layers.0.ffn.experts.0.w1.weight": "I8",
        "layers.0.ffn.experts.0.w1.scale": "F8_E8M0",
    }

    loaded = load_file(str(path))
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name].view(torch.uint8), tensor.view(torch.uint8)), name
    assert torch.equal(
        dequantize_fp8_blockwise(loaded["layers.0.attn.wq_a.weight"], loaded["layers.0.attn.wq_a.scale"]),
        dequantize_fp8_blockwise(q8, s8),
    )
    assert torch.equal(
        dequantize_fp4(loaded["layers.0.ffn.experts.0.w1.weight"], loaded["layers.0.ffn.experts.0.w1.scale"]),
        dequantize_fp4(q4, s4),
    )
