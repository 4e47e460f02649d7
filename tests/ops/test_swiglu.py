"""``clamped_swiglu``: the Triton kernel (in Triton's CPU interpreter; compiled on CUDA) against the torch reference,
and the reference against the expert's separate ops. Bound: one step of the dtype where Triton's ``exp`` differs
from torch's in the last float32 bit (``1e-2 |ref| + 1e-3`` for bf16, ``1e-5 |ref| + 1e-6`` for float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops.swiglu.reference import clamped_swiglu_reference

CASES = [(1, 64, torch.bfloat16), (5, 1030, torch.bfloat16), (3, 48, torch.float32), (0, 64, torch.float32)]
LIMIT = 7.0


def check(device: str) -> list[str]:
    from dsinfer.ops.swiglu.triton import clamped_swiglu_triton

    failures = []
    for index, (rows, inter, dtype) in enumerate(CASES):
        gen = torch.Generator().manual_seed(index)
        joined = (torch.randn(rows, 2 * inter + 6, generator=gen) * 5).to(dtype)
        gate_up = joined[:, : 2 * inter]  # a view with a longer row stride, as a split GEMM output
        got = clamped_swiglu_triton(gate_up.to(device), LIMIT).cpu()
        want = clamped_swiglu_reference(gate_up, LIMIT)
        tight = 1e-2 if dtype == torch.bfloat16 else 1e-5
        if got.shape != want.shape or got.dtype != want.dtype:
            failures.append(f"case {index}: {tuple(got.shape)} {got.dtype}")
        elif not bool(((got.float() - want.float()).abs() <= tight * want.float().abs() + tight / 10).all()):
            failures.append(f"case {index}: off by {float((got.float() - want.float()).abs().max()):.3g}")
    return failures


def run_interpreted_cases() -> list[str]:
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()  # the interpreter's float32 -> bf16 cast truncates: round to nearest even
    return check("cpu")


def test_triton_kernel_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_swiglu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
def test_triton_kernel_matches_reference_on_cuda():
    assert check("cuda") == []


def test_reference_is_the_experts_clamped_swiglu():
    gate_up = torch.randn(4, 20) * 10
    gate, up = gate_up[:, :10], gate_up[:, 10:]
    want = F.silu(gate.clamp(max=LIMIT)) * up.clamp(-LIMIT, LIMIT)
    assert torch.equal(clamped_swiglu_reference(gate_up, LIMIT), want)
