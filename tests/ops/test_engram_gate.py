"""engram_gate: the reference against the Engram layer's former inline math (bit for bit), and the Triton kernel
(interpreted on the CPU; compiled on CUDA) against the reference: one token and many, hidden sizes that do not
fill the kernel's step, the gate shut by the mask, key and value as the views of one projection the layer
passes, large and tiny dot products (both signs, and under the magnitude floor), fp32 and bf16 streams."""

from __future__ import annotations

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops import registry
from dsinfer.ops.engram_gate.reference import GATE_MAGNITUDE_FLOOR, EngramGateInputs, engram_gate_reference

CASES = [(1, 4, 64), (5, 4, 100), (3, 2, 2500), (2, 4, 5120)]  # tokens, streams, hidden


def make_inputs(tokens, streams_count, hidden, dtype, masked, generator, scale=1.0):
    projection = (torch.randn(tokens, (streams_count + 1) * hidden, generator=generator) * scale).to(dtype)
    key, value = projection.split([streams_count * hidden, hidden], dim=-1)
    key = key.unflatten(-1, (streams_count, hidden))
    streams = torch.randn(tokens, streams_count, hidden, generator=generator).to(dtype)
    weight = torch.rand(streams_count, hidden, generator=generator) + 0.5
    mask = torch.rand(tokens, generator=generator) < 0.7 if masked else None
    return streams, key, value, weight, mask, 1e-20


def former_inline(streams, key, value, weight, gate_mask, eps):
    key = key.float()
    h = streams.float()
    hidden = h.shape[-1]
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * weight * key).sum(-1) * rstd * hidden**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_MAGNITUDE_FLOOR).sqrt(), dot))
    if gate_mask is not None:
        gate = gate.masked_fill(~gate_mask.unsqueeze(-1), 0.0)
    return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)


def check(device: torch.device) -> list[str]:
    """fp32: within 1e-5 of the reference; bf16: within one bf16 rounding of the output (2**-7 relative)."""
    import dsinfer.ops.engram_gate.triton as backend

    failures = []
    generator = torch.Generator().manual_seed(0)
    for tokens, streams_count, hidden in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            for masked in (False, True):
                for scale in (1.0, 1e-6):  # 1e-6: dot products under the magnitude floor
                    inputs = make_inputs(tokens, streams_count, hidden, dtype, masked, generator, scale)
                    inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
                    want = engram_gate_reference(EngramGateInputs(*inputs))
                    got = backend.engram_gate_triton(EngramGateInputs(*inputs))
                    label = f"{tokens}x{streams_count}x{hidden} {dtype} masked={masked} scale={scale}"
                    if got.dtype != want.dtype or got.shape != want.shape:
                        failures.append(f"{label}: got {got.dtype} {tuple(got.shape)}")
                        continue
                    error = (got.float() - want.float()).abs()
                    limit = 1e-5 if dtype == torch.float32 else 2.0**-7 * want.float().abs() + 1e-6
                    if not bool((error <= limit).all()):
                        failures.append(f"{label}: max |triton - reference| = {error.max().item():.3g}")
    return failures


def run_interpreted_cases() -> list[str]:
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()
    return check(torch.device("cpu"))


def test_reference_is_the_layers_former_inline_math():
    generator = torch.Generator().manual_seed(1)
    for tokens, streams_count, hidden in CASES:
        for masked in (False, True):
            inputs = make_inputs(tokens, streams_count, hidden, torch.bfloat16, masked, generator)
            assert torch.equal(engram_gate_reference(EngramGateInputs(*inputs)), former_inline(*inputs))


def test_triton_kernel_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_engram_gate")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernel_matches_the_reference_on_cuda():
    assert check(torch.device("cuda")) == []


def test_registry_picks_the_kernel_on_cuda_only():
    assert [b.name for b in registry.backends("engram_gate")] == ["triton", "reference"]
    assert registry.choose("engram_gate", "cpu", torch.float32).name == "reference"
