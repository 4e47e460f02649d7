"""RMSNorm with and without a weight: the Triton kernels (in Triton's interpreter on the CPU, compiled on CUDA)
against the torch references."""

from __future__ import annotations

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops import registry
from dsinfer.ops.norm_rope.reference import rms_norm_reference, rms_normalize_reference

SHAPES = [(0, 64), (1, 4096), (7, 100), (3, 5, 512), (33, 1024), (2, 8192), (4, 20000)]


def column_slice(x: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, width] copied into the first columns of a wider buffer (the rest large, so a read past the
    slice shows), returned as that column slice."""
    buffer = torch.full((x.shape[0], x.shape[1] + 48), 1e4, dtype=x.dtype, device=x.device)
    buffer[:, : x.shape[1]] = x
    return buffer[:, : x.shape[1]]


def check_cases(device: torch.device) -> list[str]:
    """Every shape and dtype; float32 within float32 rounding, bf16 within one bf16 step of the reference."""
    import dsinfer.ops.norm_rope.rms_norm_triton as backend

    failures = []
    generator = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(*shape, generator=generator) * 3 + 0.5).to(dtype).to(device)
            weight = (torch.rand(shape[-1], generator=generator) + 0.5).to(device)
            if len(shape) == 3:  # a strided view, as a per-head slice would be
                x = torch.cat([x, x], dim=-2)[..., ::2, :]
            elif shape[0] % 3 == 0:  # a column slice of a wider buffer (a joined GEMM's output): read in place
                x = column_slice(x)
                if backend.row_layout(x).data_ptr() != x.data_ptr():
                    failures.append(f"{shape} {dtype}: a column slice was copied")
            expected = rms_norm_reference(x, weight, 1e-6)
            got = backend.rms_norm_triton(x, weight, 1e-6)
            step = 2**-22 if dtype == torch.float32 else 2**-7
            if got.dtype != dtype or got.shape != x.shape:
                failures.append(f"{shape} {dtype}: got {got.dtype} {tuple(got.shape)}")
            elif not ((got.float() - expected.float()).abs() <= expected.float().abs() * step + 1e-6).all():
                failures.append(f"{shape} {dtype}: max |diff| {(got.float() - expected.float()).abs().max():.3g}")
    return failures


def check_weightless_cases(device: torch.device) -> list[str]:
    """``rms_normalize``: the scale rounded to the rows' dtype as the reference does, so bf16 results agree but for
    a last-bit tie of the scale (one bf16 step of the output at most); float32 within float32 rounding."""
    import dsinfer.ops.norm_rope.rms_norm_triton as backend

    failures = []
    generator = torch.Generator().manual_seed(1)
    for shape in [(0, 512), (1, 512), (3, 64, 512), (5, 64, 128), (2, 16384), (2, 20000)]:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(*shape, generator=generator) * 2 + 0.3).to(dtype).to(device)
            if len(shape) == 2 and shape[0] > 0:
                x = column_slice(x)
            elif len(shape) == 3:  # [T, heads, head_dim] of a column slice (a joined GEMM's queries): in place
                x = column_slice(x.reshape(shape[0], -1)).view(shape)
                if backend.row_layout(x).data_ptr() != x.data_ptr():
                    failures.append(f"rms_normalize {shape} {dtype}: a [T, heads, head_dim] slice was copied")
            expected = rms_normalize_reference(x, 1e-6)
            got = backend.rms_normalize_triton(x, 1e-6)
            step = 2**-22 if dtype == torch.float32 else 2**-7
            if got.dtype != dtype or got.shape != x.shape:
                failures.append(f"rms_normalize {shape} {dtype}: got {got.dtype} {tuple(got.shape)}")
            elif not ((got.float() - expected.float()).abs() <= expected.float().abs() * step + 1e-6).all():
                diff = (got.float() - expected.float()).abs().max()
                failures.append(f"rms_normalize {shape} {dtype}: max |diff| {diff:.3g}")
    return failures


def run_interpreted_cases() -> list[str]:
    """Every case through the interpreter (TRITON_INTERPRET=1 must be set before Triton loads)."""
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()  # the interpreter's float32 -> bf16 cast truncates: round to nearest even
    return check_cases(torch.device("cpu")) + check_weightless_cases(torch.device("cpu"))


def test_triton_rms_norm_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_rms_norm_triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_rms_norm_matches_reference_on_cuda():
    assert check_cases(torch.device("cuda")) + check_weightless_cases(torch.device("cuda")) == []


@pytest.mark.parametrize("op", ["rms_norm", "rms_normalize"])
def test_registry_picks_reference_on_cpu_and_triton_on_cuda(op):
    assert registry.choose(op, "cpu", torch.float32).name == "reference"
    if torch.cuda.is_available():
        assert registry.choose(op, "cuda", torch.bfloat16).name == "triton"
