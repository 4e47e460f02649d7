"""Programmatic dependent launch (``dsinfer.ops.dependent_launch``): the switch and its errors on any machine;
on CUDA, a chain of kernels that launch as dependents (norm, FP8 GEMV, FP8 GEMV, SwiGLU, FP8 GEMV, each the next
one's input) replayed from a CUDA graph with fresh inputs gives, bit for bit, the chain launched plainly: a
kernel that read before its wait would read the previous replay's values."""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops.dependent_launch import dependent_launch as launches_dependent
from dsinfer.ops.dependent_launch import launch_options


def test_off_on_the_cpu_and_bad_settings_are_errors(monkeypatch):
    monkeypatch.setenv("DSINFER_PDL", "1")
    assert not launches_dependent(torch.device("cpu"))
    assert launch_options(torch.device("cpu")) == {}
    if torch.cuda.is_available():
        monkeypatch.setenv("DSINFER_PDL", "yes")
        with pytest.raises(ValueError, match="DSINFER_PDL must be 0 or 1"):
            launches_dependent(torch.device("cuda"))
        monkeypatch.setenv("DSINFER_PDL", "0")
        assert launch_options(torch.device("cuda")) == {}


def _chain():
    from dsinfer.ops.fp8_linear import Fp8Weight
    from dsinfer.ops.fp8_linear.gemv_triton import fp8_gemv
    from dsinfer.ops.norm_rope.rms_norm_triton import rms_norm_triton
    from dsinfer.ops.quant import quantize_fp8_blockwise
    from dsinfer.ops.swiglu.triton import clamped_swiglu_triton

    gen = torch.Generator().manual_seed(0)
    weights = []
    for rows, inputs in ((4096, 2048), (2048, 4096), (2048, 1024)):
        codes, scale = quantize_fp8_blockwise(torch.randn(rows, inputs, generator=gen) * 0.05, (128, 128))
        weights.append(Fp8Weight(codes.cuda(), scale.cuda(), (128, 128)))
    norm_weight = torch.randn(2048, generator=gen).cuda()
    x = torch.zeros(1, 2048, device="cuda", dtype=torch.bfloat16)

    def run() -> torch.Tensor:
        h = rms_norm_triton(x, norm_weight.to(x.dtype), 1e-6)
        h = fp8_gemv(h, weights[0], torch.bfloat16)
        h = fp8_gemv(h, weights[1], torch.bfloat16)
        h = clamped_swiglu_triton(h, 10.0)
        return fp8_gemv(h, weights[2], torch.bfloat16)

    return x, run


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs CUDA sm_90+"
)
def test_a_graph_of_dependent_launches_matches_plain_launches(monkeypatch):
    monkeypatch.setenv("DSINFER_PDL", "1")
    assert launches_dependent(torch.device("cuda"))
    x, run = _chain()
    inputs = [torch.randn(1, 2048, generator=torch.Generator().manual_seed(s)).to("cuda", torch.bfloat16)
              for s in range(6)]  # fmt: skip
    monkeypatch.setenv("DSINFER_PDL", "0")
    plain = []
    for value in inputs:
        x.copy_(value)
        plain.append(run().clone())
    monkeypatch.setenv("DSINFER_PDL", "1")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for value, want in zip(inputs, plain, strict=True):
        x.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
