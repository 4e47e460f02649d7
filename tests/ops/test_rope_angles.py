"""``rope_angles`` (dsinfer.ops.rope_angles): the Triton kernel against the torch reference in Triton's CPU
interpreter (integer and float positions, group starts for ratios 4 and 128 with a negative position, a rope
width that is no power of two, more rows than one program), bit for bit on CUDA, and the errors both share.

In the interpreter ``tl.cos`` / ``tl.sin`` are numpy's, which may differ from torch's CPU functions in the last
bit: the bound there is 2 float32 ulps of 1. On CUDA both call the CUDA math library's ``cosf`` / ``sinf``: the
kernel must equal torch's CUDA kernels bit for bit (torch's CPU functions differ from them in the last bit)."""

from __future__ import annotations

import math

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops.rope_angles import rope_angles_reference


def frequencies(half: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32) * 2 / (2 * half)))


# (label, positions, half, ratio)
CASES = [
    ("decode rows", torch.tensor([0, 1, 255, 4095, 65535]), 32, 1),
    ("group starts, ratio 4, a padding row at -1", torch.tensor([-1, 0, 3, 4, 7, 130, 4097]), 32, 4),
    ("group starts, ratio 128, many rows", torch.arange(0, 40 * 37, 37), 32, 128),
    ("float positions, a width of 24", torch.tensor([0.0, 2.5, 1000.0]), 24, 1),
    ("no rows", torch.zeros(0, dtype=torch.long), 32, 1),
]


def check(device: str, exact: bool) -> list[str]:
    from dsinfer.ops.rope_angles.triton import rope_angles_triton

    failures = []
    for label, positions, half, ratio in CASES:
        freq = frequencies(half)
        want = rope_angles_reference(positions.to(device), freq.to(device), ratio)  # torch on the same device
        got = rope_angles_triton(positions.to(device), freq.to(device), ratio)
        for name, g, w in zip(("cos", "sin"), got, want, strict=True):
            g, w = g.cpu(), w.cpu()
            if g.shape != w.shape or g.dtype != torch.float32:
                failures.append(f"{label} {name}: {tuple(g.shape)} {g.dtype}, expected {tuple(w.shape)}")
            elif exact and not torch.equal(g, w):
                failures.append(f"{label} {name}: {int((g != w).sum())} values differ")
            elif not exact and w.numel() and float((g - w).abs().max()) > 2 * torch.finfo(torch.float32).eps:
                failures.append(f"{label} {name}: max error {float((g - w).abs().max()):.3g}")
    return failures


def run_interpreted_cases() -> list[str]:
    return check("cpu", exact=False)


def test_rope_angles_kernel_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_rope_angles")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rope_angles_kernel_is_bit_identical_on_cuda():
    assert check("cuda", exact=True) == []


def test_group_starts_and_errors():
    """A ratio's angles are those of each group's first position (floor remainder: -1 belongs to the group at -4);
    a ratio below 1, or above 1 on float positions, is one clear error."""
    freq = frequencies(4)
    cos, sin = rope_angles_reference(torch.tensor([-1, 5, 8]), freq, 4)
    want_cos, want_sin = rope_angles_reference(torch.tensor([-4, 4, 8]), freq)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert math.isclose(float(cos[2, 0]), math.cos(8.0), rel_tol=1e-6)
    with pytest.raises(ValueError, match="ratio must be >= 1"):
        rope_angles_reference(torch.tensor([1]), freq, 0)
    with pytest.raises(ValueError, match="integer positions"):
        rope_angles_reference(torch.tensor([1.0]), freq, 2)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_rope_angles_kernel_compiles_for_hopper_with_accurate_cos_and_sin():
    """The interpreter never compiles: build the kernel for sm_90 (no GPU) and check that cos and sin are the
    accurate library functions, not the ``.approx`` instructions."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsinfer.ops.rope_angles import triton as backend

    kernel = backend._rope_angles_kernel
    constants = dict(HALF=32, BLOCK=32, ROWS=backend.ROWS_PER_PROGRAM, GROUPED=True)
    pointers = {"positions_ptr": "*i64", "inv_freq_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    signature = {name: pointers.get(name, "i32") for name in kernel.arg_names}
    signature.update({name: "constexpr" for name in constants})
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=1))  # fmt: skip
    ptx = compiled.asm["ptx"]
    assert "cos.approx" not in ptx and "sin.approx" not in ptx
