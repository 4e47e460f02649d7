"""RoPE: the Triton kernel (in Triton's interpreter on the CPU, compiled on CUDA) against the torch reference.

The kernel must equal the reference bit for bit in both dtypes (it rotates in float32 with the reference's
roundings and no fused multiply-add), on every layout the model calls it with: keys [N, dim], queries
[N, H, dim], a rank-4 x, the indexer's dim 128, a rope slice that is the whole row, strided views, the
angles of one token shared by all, and the inverse rotation; in place (only the rope channels of x rewritten,
also on a column slice of a wider buffer, as a joined GEMM's output is) as well as into a new tensor.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops import registry
from dsinfer.ops.norm_rope.reference import rope_reference

TOKENS = (0, 1, 5, 130)
# The interpreter runs each program in Python (about 10 ms a program of the rope kernel, whose grid is a program per
# token and head), so it takes few tokens, enough to cross the program boundaries the kernels have: the row-chain
# kernel (a new tensor, forward) takes 4 rows a program at dim 512 and 16 at dims 64 to 128; 7 tokens are 7, 21 and
# 42 rows, several programs with a partial last one, programs spanning tokens, at every dim. The rope kernel (in
# place, inverse) has no boundary in tokens: a program per token and head. CUDA runs every token count.
INTERPRETED_TOKENS = (0, 1, 7)
DIMS = ((512, 64), (128, 64), (64, 64))  # (dim, rope_dim): V4 heads and keys, the indexer, no nope channels
MIDDLES = ((), (3,), (2, 3))  # x is [N, *middle, dim]
DTYPES = (torch.bfloat16, torch.float32)


def make_inputs(tokens, middle, dim, rope_dim, dtype, layout, generator, device):
    """x and float32 angles; ``layout`` "strided" takes x as a view with a channel stride of 2 and a strided
    token axis, "shared" gives one token's angles to all (cos [1, half], broadcast like the reference's)."""
    half = rope_dim // 2
    shape = (tokens, *middle, dim)
    if layout == "strided":
        x = (torch.randn(*shape[:-1], 2 * dim, generator=generator) * 4).to(dtype)[..., ::2]
        x = torch.cat([x, x], dim=0)[::2] if tokens else x
    else:
        x = (torch.randn(*shape, generator=generator) * 4).to(dtype)
    angle_rows = 1 if layout == "shared" else tokens
    angles = torch.rand(angle_rows, half, generator=generator) * 2e3  # large angles: every quadrant
    cos, sin = angles.cos(), angles.sin()
    if layout == "strided":  # angles as a column slice, as a [N, 2 * half] table would give
        cos, sin = torch.cat([cos, sin], dim=-1)[:, :half], torch.cat([sin, cos], dim=-1)[:, :half]
    return x.to(device), cos.to(device), sin.to(device)


def cases(token_counts=TOKENS):
    for tokens in token_counts:
        for dim, rope_dim in DIMS:
            for middle in MIDDLES:
                for dtype in DTYPES:
                    for inverse in (False, True):
                        yield tokens, middle, dim, rope_dim, dtype, inverse, "contiguous"
    for dtype in DTYPES:  # the layouts, on a few shapes
        for layout in ("strided", "shared"):
            for tokens, middle in ((5, ()), (max(token_counts), (3,)), (5, (2, 3))):
                yield tokens, middle, 512, 64, dtype, layout == "strided", layout
    yield 7, (4,), 100, 12, torch.bfloat16, False, "contiguous"  # 6 pairs, 88 nope channels: padded blocks
    yield 7, (4,), 100, 12, torch.float16, True, "strided"  # float16 too


def check_cases(device: torch.device, token_counts=TOKENS) -> list[str]:
    """Every case; the output must have the reference's shape and dtype and equal it bit for bit."""
    import dsinfer.ops.norm_rope.rope_triton as backend

    failures = []
    generator = torch.Generator().manual_seed(0)
    for tokens, middle, dim, rope_dim, dtype, inverse, layout in cases(token_counts):
        label = f"N={tokens} middle={middle} dim={dim} rope={rope_dim} {dtype} inverse={inverse} {layout}"
        x, cos, sin = make_inputs(tokens, middle, dim, rope_dim, dtype, layout, generator, device)
        if not backend.serves(x, cos, sin):
            failures.append(f"{label}: the kernel does not take it")
            continue
        expected = rope_reference(x, cos, sin, inverse)
        got = backend.rope_triton(x, cos, sin, inverse)
        if got.dtype != expected.dtype or got.shape != expected.shape:
            failures.append(f"{label}: got {got.dtype} {tuple(got.shape)}, want {expected.dtype} {expected.shape}")
        elif not torch.equal(got, expected):
            differ = (got != expected).sum().item()
            failures.append(f"{label}: {differ} elements differ, max |diff| {(got - expected).abs().max():.3g}")
        owned = x.clone() if layout == "contiguous" else x.clone().transpose(0, -1).contiguous().transpose(0, -1)
        owned.copy_(x)  # in place: a tensor the caller owns (strided layouts go to the reference's in-place path)
        got = backend.rope_triton(owned, cos, sin, inverse, True)
        if got is not owned or not torch.equal(owned, expected):
            failures.append(f"{label}: in place, not the reference's result in x itself")
        # in place on a column slice of a wider buffer (a joined GEMM's output): the kernel, not the reference
        width = x[:1].numel() if tokens else 0
        buffer = torch.full((tokens, width + 16), 7.0, dtype=dtype, device=device)
        sliced = buffer[:, :width].view(x.shape)
        sliced.copy_(x)
        if backend.token_rows(sliced) is None:
            failures.append(f"{label}: a column slice is not taken in place")
        got = backend.rope_triton(sliced, cos, sin, inverse, True)
        if got is not sliced or not torch.equal(sliced, expected) or not bool((buffer[:, width:] == 7.0).all()):
            failures.append(f"{label}: in place on a column slice, not the reference's result (or past the slice)")
    return failures


def run_interpreted_cases() -> list[str]:
    """Every case at the interpreter's token counts (TRITON_INTERPRET=1 must be set before Triton loads)."""
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()  # the interpreter's float32 -> bf16 cast truncates: round to nearest even
    return check_cases(torch.device("cpu"), INTERPRETED_TOKENS)


def test_triton_rope_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_rope_triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_rope_matches_reference_on_cuda():
    assert check_cases(torch.device("cuda")) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_rope_is_the_ops_table_choice_on_cuda():
    x = torch.randn(3, 4, 512, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(3, 32, device="cuda")
    rope = registry.resolve("cuda", torch.bfloat16).rope
    assert torch.equal(rope(x, angles.cos(), angles.sin()), rope_reference(x, angles.cos(), angles.sin()))


def test_registry_picks_reference_on_cpu_and_triton_on_cuda():
    names = [b.name for b in registry.backends("rope")]
    assert names[0] == "triton" and names[-1] == "reference"
    assert registry.choose("rope", "cpu", torch.float32).name == "reference"
    if torch.cuda.is_available():
        assert registry.choose("rope", "cuda", torch.bfloat16).name == "triton"


def test_inputs_the_kernel_does_not_take_go_to_the_reference(monkeypatch):
    import dsinfer.ops.norm_rope.rope_triton as backend

    def refuse(*args, **kwargs):
        raise AssertionError("the kernel was launched")

    monkeypatch.setattr(backend, "rope_launch", refuse)
    x = torch.randn(4, 3, 16)
    angles = torch.rand(4, 4)
    cos, sin = angles.cos(), angles.sin()
    for args in [
        (x.double(), cos.double(), sin.double()),  # float64: the reference computes in float64
        (x, cos.bfloat16(), sin.bfloat16()),  # angles not float32
        (x[0, 0], cos[0], sin[0]),  # rank 1
        (x, cos[:2], sin[:2]),  # angles for another token count
        (x[..., :6], cos, sin),  # rope slice wider than the row
    ]:
        assert not backend.serves(*args)
        if args[0].shape[-1] >= 2 * args[1].shape[-1] and args[1].shape[0] in (args[0].shape[0], 1):
            assert torch.equal(backend.rope_triton(*args, True), rope_reference(*args, True))
    assert backend.serves(x, cos, sin)
