"""``rms_normalize_rope``: the fused query norm + RoPE kernel (in Triton's interpreter on the CPU, compiled on
CUDA) against the unfused kernels (``rms_normalize`` then ``rope``): bit for bit in bf16 and fp16, where the scale
is rounded to the dtype (in float32 the compiler may order the row's sum of squares differently); and against the
reference within the norm kernel's tolerance (its sum runs in another order than torch's mean).

Layouts: [N, H, dim] queries (contiguous, a [T, heads, head_dim] view of a wider GEMM output's columns, and a
layout no view can flatten, which the kernel reads from a copy), [N, dim] rows, the indexer's dim 128, a width
that is no power of two, one token's angles shared by all, zero tokens; bf16, fp16 and float32.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops import registry
from dsinfer.ops.norm_rope.reference import rms_normalize_rope_reference

TOKENS = (0, 1, 5, 67)
# The interpreter runs each program in Python (the unfused rope kernel's grid is a program per token and head), so it
# takes few tokens, enough to cross the norm kernels' program boundaries: 4 rows a program at dim 512, 16 at dims 100
# and 128. 7 tokens are 28, 7, 21 and 42 rows of SHAPES: several programs, a partial last one (but at [N, 4, 512],
# where a program is a token), programs spanning tokens. CUDA runs every token count.
INTERPRETED_TOKENS = (0, 1, 7)
SHAPES = (((4,), 512, 64), ((), 512, 64), ((3,), 128, 64), ((2, 3), 100, 12))  # (middle, dim, rope_dim)
DTYPES = (torch.bfloat16, torch.float32, torch.float16)
LAYOUTS = ("contiguous", "columns", "scattered", "shared")


def make_inputs(tokens, middle, dim, rope_dim, dtype, layout, generator, device):
    shape = (tokens, *middle, dim)
    x = (torch.randn(*shape, generator=generator) * 3 + 0.2).to(dtype)
    if layout == "columns":  # the first columns of a wider buffer (a joined GEMM), viewed as [N, ..., dim]
        row = x[0].numel() if tokens else 0
        buffer = torch.full((tokens, row + 24), 1e3, dtype=dtype)
        buffer[:, :row] = x.reshape(tokens, row)
        x = buffer[:, :row].view(shape)
    elif layout == "scattered" and middle:  # middle axes transposed: no [N, M, dim] view exists
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    half = rope_dim // 2
    angles = torch.rand(1 if layout == "shared" else tokens, half, generator=generator) * 2e3
    return x.to(device), angles.cos().to(device), angles.sin().to(device)


def cases(token_counts=TOKENS):
    for tokens in token_counts:
        for middle, dim, rope_dim in SHAPES:
            for dtype in DTYPES:
                for layout in LAYOUTS:
                    yield tokens, middle, dim, rope_dim, dtype, layout


def check_cases(device: torch.device, token_counts=TOKENS) -> list[str]:
    import dsinfer.ops.norm_rope.row_chain_triton as backend
    from dsinfer.ops.norm_rope.rms_norm_triton import rms_normalize_triton
    from dsinfer.ops.norm_rope.rope_triton import rope_triton

    failures = []
    generator = torch.Generator().manual_seed(0)
    for tokens, middle, dim, rope_dim, dtype, layout in cases(token_counts):
        label = f"N={tokens} middle={middle} dim={dim} rope={rope_dim} {dtype} {layout}"
        x, cos, sin = make_inputs(tokens, middle, dim, rope_dim, dtype, layout, generator, device)
        if not backend.takes(x, cos, sin):
            failures.append(f"{label}: the kernel does not take it")
            continue
        before = x.clone()
        unfused = rope_triton(rms_normalize_triton(x, 1e-6), cos, sin, False, True)
        expected = rms_normalize_rope_reference(x, 1e-6, cos, sin)
        got = backend.rms_normalize_rope_triton(x, 1e-6, cos, sin)
        # the norm's tolerance: its sum runs in another order, so a rounding tie of the scale can differ by one step
        # of the dtype, which the rotation carries into values of the rows' magnitude (about 1 after the norm)
        step = {torch.float32: 2**-22, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
        if got.dtype != expected.dtype or got.shape != expected.shape:
            failures.append(f"{label}: got {got.dtype} {tuple(got.shape)}, want {expected.dtype} {expected.shape}")
        elif dtype != torch.float32 and not torch.equal(got, unfused):
            differ = (got != unfused).sum().item()
            failures.append(f"{label}: {differ} elements differ from the unfused kernels")
        elif not ((got.float() - expected.float()).abs() <= (expected.float().abs() + 8) * step).all():
            failures.append(f"{label}: max |diff| from the reference {(got - expected).abs().max():.3g}")
        if not torch.equal(x, before):
            failures.append(f"{label}: the input changed")
    return failures


def run_interpreted_cases() -> list[str]:
    """Every case at the interpreter's token counts (TRITON_INTERPRET=1 must be set before Triton loads)."""
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()  # the interpreter's float32 -> bf16 cast truncates: round to nearest even
    return check_cases(torch.device("cpu"), INTERPRETED_TOKENS)


def test_triton_normalize_rope_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_norm_rope_triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_normalize_rope_matches_reference_on_cuda():
    assert check_cases(torch.device("cuda")) == []


def test_registry_picks_reference_on_cpu_and_triton_on_cuda():
    assert registry.choose("rms_normalize_rope", "cpu", torch.float32).name == "reference"
    if torch.cuda.is_available():
        assert registry.choose("rms_normalize_rope", "cuda", torch.bfloat16).name == "triton"


def test_inputs_the_kernel_does_not_take_go_to_the_reference(monkeypatch):
    import dsinfer.ops.norm_rope.row_chain_triton as backend

    x = torch.randn(3, 2, 15)  # odd width
    angles = torch.rand(3, 4)
    assert not backend.takes(x, angles.cos(), angles.sin())
    got = backend.rms_normalize_rope_triton(x, 1e-6, angles.cos(), angles.sin())
    assert torch.equal(got, rms_normalize_rope_reference(x, 1e-6, angles.cos(), angles.sin()))


def test_reference_is_norm_then_rope_and_keeps_autograd():
    from dsinfer.ops.norm_rope.reference import rms_normalize_reference, rope_reference

    x = torch.randn(4, 3, 64, requires_grad=True)
    angles = torch.rand(4, 16)
    got = rms_normalize_rope_reference(x, 1e-6, angles.cos(), angles.sin())
    want = rope_reference(rms_normalize_reference(x, 1e-6), angles.cos(), angles.sin())
    assert torch.equal(got, want)
    got.square().sum().backward()  # out of place under autograd: the graph is intact
    assert x.grad is not None and torch.isfinite(x.grad).all()
