"""Two independent chains of a step on two streams (``dsinfer.ops.side_stream``): the switches and their errors,
the split kernels' separate arrival counts per lane, and, on CUDA, two chains of split FP8 GEMVs run beside each
other (eagerly and replayed from a CUDA graph with fresh inputs) giving bit for bit what they give one after the
other. Had both streams' split launches shared one buffer of arrival counts, the tiles' counts would mix and the
sums come out wrong or never finish."""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops.side_stream import beside, overlap_max_tokens, overlaps
from dsinfer.ops.split_arrivals import MAIN_LANE, arrival_counts, arrival_lane, current_lane

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_on_the_cpu_the_chains_run_in_order_on_one_stream():
    calls = []
    side, main = beside(lambda: calls.append("side") or 1, lambda: calls.append("main") or 2, torch.zeros(1, 4))
    assert (side, main, calls) == (1, 2, ["side", "main"])
    assert not overlaps(torch.zeros(1, 4))


def test_settings_and_their_errors(monkeypatch):
    monkeypatch.delenv("DSINFER_OVERLAP_MAX_TOKENS", raising=False)
    assert overlap_max_tokens() == 256
    monkeypatch.setenv("DSINFER_OVERLAP_MAX_TOKENS", "8")
    assert overlap_max_tokens() == 8
    monkeypatch.setenv("DSINFER_OVERLAP_MAX_TOKENS", "-1")
    with pytest.raises(ValueError, match="DSINFER_OVERLAP_MAX_TOKENS must be a non-negative integer"):
        overlap_max_tokens()
    monkeypatch.setenv("DSINFER_OVERLAP_MAX_TOKENS", "8")
    if torch.cuda.is_available():
        x = torch.zeros(8, 4, device="cuda")
        assert overlaps(x) and not overlaps(torch.zeros(9, 4, device="cuda"))
        monkeypatch.setenv("DSINFER_OVERLAP", "0")
        assert not overlaps(x)
        monkeypatch.setenv("DSINFER_OVERLAP", "on")
        with pytest.raises(ValueError, match="DSINFER_OVERLAP must be 0 or 1"):
            overlaps(x)


def test_each_lane_has_its_own_arrival_counts_and_the_lane_is_restored():
    device = torch.device("cpu")
    main = arrival_counts(device, 4)
    with arrival_lane("side"):
        assert current_lane() == "side"
        side = arrival_counts(device, 4)
        with arrival_lane("other"):
            assert current_lane() == "other"
        assert current_lane() == "side"
    assert current_lane() == MAIN_LANE
    assert side is not None and main is not None and side.data_ptr() != main.data_ptr()
    assert arrival_counts(device, 4) is main


def _gemv_chains():
    from dsinfer.ops.fp8_linear import Fp8Weight
    from dsinfer.ops.fp8_linear.gemv_triton import fp8_gemv
    from dsinfer.ops.quant import quantize_fp8_blockwise

    gen = torch.Generator().manual_seed(0)
    chains = []
    for widths in ((2048, 4096, 2048, 4096), (4096, 2048, 4096, 1024)):
        weights = []
        for inputs, rows in zip(widths, widths[1:], strict=False):
            codes, scale = quantize_fp8_blockwise(torch.randn(rows, inputs, generator=gen) * 0.05, (128, 128))
            weights.append((codes.cuda(), scale.cuda()))
        chains.append(weights)
    inputs = [torch.zeros(1, chain[0][0].shape[1], device="cuda", dtype=torch.bfloat16) for chain in chains]

    def run(weights, x):
        def chain():
            y = x
            for codes, scale in weights:  # wide inputs: split-K launches, which count their tiles' arrivals
                y = fp8_gemv(y, Fp8Weight(codes, scale, (128, 128)), torch.bfloat16)
            return y

        return chain

    first, second = (run(weights, x) for weights, x in zip(chains, inputs, strict=True))
    return inputs, first, second


@cuda
def test_split_gemv_chains_beside_each_other_equal_them_in_order(monkeypatch):
    monkeypatch.setenv("DSINFER_OVERLAP", "1")
    inputs, first, second = _gemv_chains()
    gen = torch.Generator().manual_seed(1)
    for x in inputs:
        x.copy_(torch.randn(x.shape, generator=gen))
    want = (first().clone(), second().clone())
    got = beside(first, second, inputs[0])
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

    from dsinfer.graph_capture import capture_graph

    graph, captured = capture_graph(lambda: beside(first, second, inputs[0]))
    for seed in range(2, 12):
        gen = torch.Generator().manual_seed(seed)
        for x in inputs:
            x.copy_(torch.randn(x.shape, generator=gen))
        graph.replay()
        want = (first(), second())
        torch.cuda.synchronize()
        for got_out, want_out in zip(captured, want, strict=True):
            assert torch.equal(got_out, want_out), f"replay {seed}: the chains beside each other differ"


@cuda
def test_the_side_work_runs_on_the_side_stream(monkeypatch):
    monkeypatch.setenv("DSINFER_OVERLAP", "1")
    x = torch.ones(1, 4, device="cuda")
    main = torch.cuda.current_stream()
    streams = beside(lambda: torch.cuda.current_stream(), lambda: torch.cuda.current_stream(), x)
    assert streams[0] != main and streams[1] == main
