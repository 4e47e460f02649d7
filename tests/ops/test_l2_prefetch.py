"""L2 prefetches of weights (``dsinfer.ops.l2_prefetch``): the switch and its errors, which weights qualify; on
CUDA (sm_90+), the kernels that prefetch (the one-token FP8 GEMV, the few-token FP8 kernel, the routed experts'
decode GEMVs) give the same bits with the prefetch on and off, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops.l2_prefetch import l2_prefetch, rows_prefetchable

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def test_off_on_the_cpu_and_bad_settings_are_errors(monkeypatch):
    monkeypatch.setenv("DSINFER_L2_PREFETCH", "1")
    assert not l2_prefetch(torch.device("cpu"))
    monkeypatch.setenv("DSINFER_L2_PREFETCH", "on")
    with pytest.raises(ValueError, match="DSINFER_L2_PREFETCH must be 0 or 1"):
        l2_prefetch(torch.device("cpu"))


def test_rows_qualify_when_back_to_back_and_aligned():
    codes = torch.zeros(64, 256, dtype=torch.uint8)
    assert rows_prefetchable(codes)
    assert rows_prefetchable(codes[16:32])  # whole rows of an aligned weight
    assert not rows_prefetchable(codes[:, 8:])  # not contiguous
    assert not rows_prefetchable(torch.zeros(8, 72, dtype=torch.uint8))  # 72-byte rows: not whole 16-byte units
    assert not rows_prefetchable(torch.zeros(64 * 256 + 1, dtype=torch.uint8)[1:].view(64, 256))  # first byte
    assert rows_prefetchable(torch.zeros(4, 32, 64, dtype=torch.int32))  # experts' packed rows


def _both(monkeypatch, run):
    """``run()`` with the prefetch off, then on (eagerly, and from a graph replayed twice)."""
    monkeypatch.setenv("DSINFER_L2_PREFETCH", "0")
    off = run().clone()
    monkeypatch.setenv("DSINFER_L2_PREFETCH", "1")
    assert l2_prefetch(torch.device("cuda"))
    eager = run().clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append(captured.clone())
    return off, eager, replays


@pytest.mark.skipif(not HOPPER, reason="needs CUDA sm_90+")
@pytest.mark.parametrize("rows, inputs, tokens, groups", [(4096, 8192, 1, 1), (8192, 1024, 1, 8), (40960, 1024, 1, 1),
                                                          (2048, 4096, 7, 1), (24576, 1280, 1, 1)])  # fmt: skip
def test_fp8_kernels_give_the_same_bits_with_the_prefetch(monkeypatch, rows, inputs, tokens, groups):
    from dsinfer.ops.fp8_linear.triton import fp8_linear_triton
    from dsinfer.ops.quant import quantize_fp8_blockwise

    gen = torch.Generator().manual_seed(rows + inputs)
    codes, scale = quantize_fp8_blockwise(torch.randn(rows, inputs, generator=gen) * 0.05, (128, 128))
    codes, scale = codes.cuda(), scale.cuda()
    x = torch.randn(tokens, groups * inputs, generator=gen).to("cuda", torch.bfloat16)
    off, eager, replays = _both(monkeypatch, lambda: fp8_linear_triton(x, codes, scale, (128, 128), x.dtype, groups))
    assert torch.equal(off, eager)
    assert all(torch.equal(off, replay) for replay in replays)


@pytest.mark.skipif(not HOPPER, reason="needs CUDA sm_90+")
@pytest.mark.parametrize("hidden, inter", [(4096, 2048), (5120, 2304)])  # V4-Flash's and V4.1-Flash's widths
def test_expert_gemvs_give_the_same_bits_with_the_prefetch(monkeypatch, hidden, inter):
    from test_moe_decode_gemv import random_experts, routing

    from dsinfer.ops.moe.decode_triton import routed_moe_decode_gemv

    weights = random_experts(32, hidden, inter, seed=5, device="cuda", gain=-3)
    ids, mix = routing(1, 6, 32, seed=6, device="cuda")
    ids[0, 3] = -1  # a bad id: reads nothing, adds zeros
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(7)).to("cuda", torch.bfloat16)
    off, eager, replays = _both(monkeypatch, lambda: routed_moe_decode_gemv(x, weights, ids, mix, 10.0))
    assert torch.equal(off, eager)
    assert all(torch.equal(off, replay) for replay in replays)
