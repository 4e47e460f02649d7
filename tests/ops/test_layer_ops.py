"""The layers' ops (norms and RoPE, compressor pooling, indexer scores and top-k, fake quantization, Engram gather):
every registered backend against its torch reference on random inputs, and each reference against an independent
computation of the same definition."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dsinfer.ops.cache_codec import cache_decode_reference, cache_encode_reference
from dsinfer.ops.compressor import compressor_pool_reference
from dsinfer.ops.engram_gather import engram_gather_triton, gather_dequantize_reference
from dsinfer.ops.engram_gather import kernel as engram_kernel
from dsinfer.ops.fake_quant import fake_quant_fp4, fake_quant_fp8
from dsinfer.ops.index_scores import index_scores_reference, index_topk_reference
from dsinfer.ops.norm_rope import rms_norm_reference, rope_reference
from dsinfer.ops.registry import REFERENCE, backends


def _random(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _inputs(op: str):
    """(args, kwargs) of one random call of ``op``."""
    if op == "rms_norm":
        return (_random(7, 3, 64), _random(64, seed=1) + 1, 1e-6), {}
    if op == "rope":
        x, angles = _random(5, 4, 32), _random(5, 8, seed=1)
        return (x, angles.cos(), angles.sin(), True), {}
    if op == "compressor_pool":
        gates = _random(6, 8, 16, seed=1)
        gates[0, :4] = float("-inf")
        return (_random(6, 8, 16), gates, _random(16, seed=2) + 1, 1e-6, torch.float32), {}
    if op in ("index_scores", "index_topk"):
        args = (_random(5, 4, 16), _random(5, 11, 16, seed=1), _random(5, 4, seed=2), torch.tensor([0, 1, 5, 11, 9]))
        return (args + (6,) if op == "index_topk" else args), {}
    if op == "fake_quant_fp8":
        return (_random(9, 64, scale=30),), {"block": 32}
    if op == "fake_quant_fp4":
        return (_random(9, 64, scale=3), 16, True), {}
    if op == "cache_encode":
        return (fake_quant_fp4(_random(9, 64, scale=3), 16, True), "e2m1", 16, "e4m3"), {}
    if op == "cache_decode":
        codes, scales = cache_encode_reference(fake_quant_fp8(_random(9, 64, scale=30), 32), "e4m3", 32, "ue8m0")
        return (codes, scales, "e4m3", 32, "ue8m0", torch.bfloat16), {}
    raise AssertionError(op)


LAYER_OPS = [
    "rms_norm",
    "rope",
    "compressor_pool",
    "index_scores",
    "index_topk",
    "fake_quant_fp8",
    "fake_quant_fp4",
    "cache_encode",
    "cache_decode",
]


@pytest.mark.parametrize("op", LAYER_OPS)
def test_every_cpu_backend_matches_the_reference(op):
    found = {backend.name: backend for backend in backends(op)}
    assert REFERENCE in found
    args, kwargs = _inputs(op)
    expected = found[REFERENCE].fn(*args, **kwargs)
    for backend in found.values():
        if backend.serves(torch.device("cpu"), torch.float32):
            got = backend.fn(*args, **kwargs)
            mine, theirs = (v if isinstance(v, tuple) else (v,) for v in (got, expected))
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), (op, backend.name)


def test_rms_norm_is_torchs_rms_norm():
    x, weight, eps = _inputs("rms_norm")[0]
    assert torch.allclose(rms_norm_reference(x, weight, eps), F.rms_norm(x, (64,), weight, eps), atol=1e-6)
    half = rms_norm_reference(x.bfloat16(), weight, eps)
    assert half.dtype == torch.bfloat16  # computed in float32, cast back once


def test_rope_rotates_interleaved_pairs_of_the_tail_only():
    x, angles = _random(5, 4, 32), _random(5, 8, seed=1)
    out = rope_reference(x, angles.cos(), angles.sin())
    assert torch.equal(out[..., :16], x[..., :16])  # the nope part is untouched
    pairs = torch.view_as_complex(x[..., 16:].reshape(5, 4, 8, 2).contiguous())
    rotated = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)[:, None, :]).flatten(-2)
    assert torch.allclose(out[..., 16:], rotated, atol=1e-5)
    back = rope_reference(out, angles.cos(), angles.sin(), inverse=True)
    assert torch.allclose(back, x, atol=1e-5)


def test_compressor_pool_is_a_per_channel_softmax_average_then_norm():
    values, gates, weight, eps, dtype = _inputs("compressor_pool")[0]
    out = compressor_pool_reference(values, gates, weight, eps, dtype)
    for n in range(values.shape[0]):
        for channel in range(0, 16, 5):
            g = gates[n, :, channel]
            w = [math.exp(v - float(g.max())) if v != float("-inf") else 0.0 for v in g.tolist()]
            pooled = sum(wi * float(vi) for wi, vi in zip(w, values[n, :, channel].tolist(), strict=True)) / sum(w)
            mixed = (torch.softmax(gates[n], dim=0) * values[n]).sum(0)
            assert abs(float(mixed[channel]) - pooled) < 1e-5
        mixed = (torch.softmax(gates[n], dim=0) * values[n]).sum(0)
        assert torch.allclose(out[n], F.rms_norm(mixed, (16,), weight, eps), atol=1e-5)


def test_index_scores_follow_the_definition():
    q, keys, head_weights, visible = _inputs("index_scores")[0]
    scores = index_scores_reference(q, keys, head_weights, visible)
    for t in range(5):
        for w in range(11):
            if w >= int(visible[t]):
                assert scores[t, w] == float("-inf")
                continue
            want = sum(
                float(head_weights[t, h]) * max(0.0, float(q[t, h] @ keys[t, w])) / 4.0 for h in range(4)
            )  # 1 / sqrt(16)
            assert abs(float(scores[t, w]) - want) < 1e-4
    shared = index_scores_reference(q, keys[0], head_weights, visible)  # one key set for every query
    assert torch.allclose(shared, index_scores_reference(q, keys[0].expand(5, -1, -1), head_weights, visible))


def test_index_topk_returns_ascending_indices_and_breaks_ties_by_the_lowest():
    q, keys, head_weights, visible, k = _inputs("index_topk")[0]
    chosen, real = index_topk_reference(q, keys, head_weights, visible, k)
    scores = index_scores_reference(q, keys, head_weights, visible)
    assert chosen.shape == real.shape == (5, 6)
    assert torch.equal(real.sum(-1), visible.clamp(max=k))
    for t in range(5):
        picked = chosen[t][real[t]].tolist()
        assert picked == sorted(picked)
        best = sorted(range(int(visible[t])), key=lambda w: (-float(scores[t, w]), w))[:k]
        assert sorted(best) == picked
    tied = torch.zeros(2, 3, 4)  # every score 0 after the ReLU: the lowest entries win
    chosen, real = index_topk_reference(tied, _random(2, 9, 4), torch.ones(2, 3), torch.tensor([9, 9]), 4)
    assert chosen.tolist() == [[0, 1, 2, 3]] * 2 and bool(real.all())


def test_fake_quantization_is_idempotent_and_on_the_grid():
    x = _random(9, 64, scale=30)
    once = fake_quant_fp8(x, 32)
    assert torch.equal(fake_quant_fp8(once, 32), once)
    scales = once.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    assert float((once.unflatten(-1, (-1, 32)).abs() - scales).max()) <= 0  # nothing above the block's max
    fp4 = fake_quant_fp4(_random(9, 64, scale=3), 32, False)  # power-of-two scales: re-rounding is exact
    assert torch.equal(fake_quant_fp4(fp4, 32, False), fp4)
    assert len(torch.unique(fp4.unflatten(-1, (-1, 32))[0, 0].abs())) <= 8  # e2m1 has 8 magnitudes


@pytest.mark.parametrize(
    ("element", "block", "scale", "rounding"),
    [
        ("e4m3", 32, "ue8m0", lambda x: fake_quant_fp8(x, 32)),  # window KV
        ("e2m1", 16, "e4m3", lambda x: fake_quant_fp4(x, 16, True)),  # compressed KV
        ("e2m1", 32, "ue8m0", lambda x: fake_quant_fp4(x, 32, False)),  # index keys
    ],
)
def test_cache_codecs_give_back_the_rounded_rows_bit_for_bit(element, block, scale, rounding):
    rows = rounding(_random(33, 128, seed=4, scale=5) * torch.logspace(-6, 2, 128))  # tiny blocks too
    codes, scales = cache_encode_reference(rows, element, block, scale)
    assert codes.shape[-1] == (128 if element == "e4m3" else 64) and scales.shape[-1] == 128 // block
    for dtype in (torch.float32, torch.bfloat16):
        want = rows.to(dtype)
        assert torch.equal(cache_decode_reference(codes, scales, element, block, scale, dtype).view(-1), want.view(-1))


def _engram_table(rows=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 255, (rows, 256), generator=generator, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    scales = torch.randint(110, 140, (rows, 8), generator=generator, dtype=torch.uint8)
    return codes, scales


def test_engram_gather_reference_dequantises_codes_times_power_of_two_scales():
    codes, scales = _engram_table()
    ids = torch.tensor([3, 3, 39, 0])
    rows = gather_dequantize_reference(codes, scales, ids, torch.float32)
    values = codes[ids].view(torch.float8_e4m3fn).float().unflatten(-1, (8, 32))
    want = (values * torch.exp2(scales[ids].float() - 127)[..., None]).flatten(-2)
    assert torch.equal(rows, want)
    cuda_only = {b.name: b for b in backends("engram_gather")}["triton"]
    assert cuda_only.devices == ("cuda",)


def test_engram_gather_triton_backend_matches_the_reference_in_the_interpreter(monkeypatch):
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    kernel = engram_kernel._gather_dequantize_kernel
    monkeypatch.setattr(engram_kernel, "_gather_dequantize_kernel", interpreter.InterpretedFunction(kernel.fn))
    codes, scales = _engram_table(seed=3)
    ids = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        got = engram_gather_triton(codes, scales, ids, dtype, max_programs=3)
        assert torch.equal(got, gather_dequantize_reference(codes, scales, ids, dtype))
