"""mHC's stream collapse and expand: the Triton kernels (in Triton's CPU interpreter; compiled on CUDA) against
the torch references, and the references against the expressions the models were validated with.

Bounds. Float32: 2**-20 of the sum of the terms' magnitudes (the kernels accumulate in another order, with
fused multiply-adds). Bf16: the collapse rounds one float32 sum once, as the reference does, so the two differ
by at most one bf16 unit in the last place (2**-7 of the result) plus the float32 term. The expand rounds once
where the reference rounds the spread ``a = post * y``, the mix ``b = sum_j comb_ji * stream_j`` and their sum:
half a unit (2**-8 relative) for each of those four roundings, i.e.
``|got - ref| <= 2**-8 * (|a| + |b| + |a + b| + |ref|)`` plus the float32 term.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.layers.mhc import collapse_streams, expand_streams, hyper_head
from dsinfer.ops import registry
from dsinfer.ops.mhc.reference import hc_collapse_reference, hc_expand_reference


@dataclass(frozen=True)
class Case:
    """Random mHC inputs: ``tokens`` x ``n`` streams of ``width``; ``strided``: every input a non-contiguous
    view; ``lead``: an extra leading axis (tokens split into 2 x tokens/2)."""

    tokens: int
    width: int
    n: int = 4
    dtype: torch.dtype = torch.float32
    strided: bool = False
    lead: bool = False
    seed: int = 0


# Tokens a program: 4 in the collapse, 2 in the expand. 7 and 34 tokens end in a partial collapse program (34 after
# eight whole ones); the expand's last program is partial at 7 and whole at 34.
CASES = [
    Case(tokens, width, n, dtype, strided=(tokens == 7 and width == 100), seed=i)
    for i, (tokens, width, n, dtype) in enumerate(
        (tokens, width, n, dtype)
        for tokens in (0, 1, 7, 34)
        for width in (64, 100, 4096)
        for n in (2, 4)
        for dtype in (torch.float32, torch.bfloat16)
    )
] + [
    Case(34, 4096, 4, torch.bfloat16, strided=True, seed=100),
    Case(33, 200, 8, torch.bfloat16, seed=101),  # the largest n the models could use
    Case(5, 64, 3, torch.float32, seed=102),  # n not a power of two: the backend runs the reference
    Case(12, 96, 4, torch.bfloat16, lead=True, seed=103),
    Case(9, 0, 4, torch.float32, seed=104),  # an empty width
]


def _maybe_strided(tensor: torch.Tensor, strided: bool, gen: torch.Generator) -> torch.Tensor:
    """``tensor``'s values as a non-contiguous view (every other column of a twice-as-wide buffer) if asked."""
    if not strided:
        return tensor
    wide = torch.randn(*tensor.shape[:-1], 2 * tensor.shape[-1], generator=gen).to(tensor.dtype)
    wide[..., ::2] = tensor
    view = wide[..., ::2]
    assert not view.is_contiguous() or view.numel() <= 1
    return view


def make_inputs(case: Case, device: torch.device) -> dict[str, torch.Tensor]:
    """Streams and block output of magnitude a few units; ``pre`` in (0, 1], ``post`` in (0, 2) and a
    non-symmetric ``comb`` in (0, 1], as the models' weights are (a transposed ``comb`` reads other values)."""
    gen = torch.Generator().manual_seed(case.seed)
    t, n, d = case.tokens, case.n, case.width
    inputs = {
        "streams": (3 * torch.randn(t, n, d, generator=gen)).to(case.dtype),
        "block_output": (2 * torch.randn(t, d, generator=gen)).to(case.dtype),
        "pre": torch.rand(t, n, generator=gen) + 1e-6,
        "post": 2 * torch.rand(t, n, generator=gen),
        "comb": torch.rand(t, n, n, generator=gen),
    }
    inputs = {name: _maybe_strided(value, case.strided, gen) for name, value in inputs.items()}
    if case.lead:
        inputs = {name: value.unflatten(0, (2, t // 2)) for name, value in inputs.items()}
    return {name: value.to(device) for name, value in inputs.items()}


def _excess(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> str | None:
    """None if ``got`` is within ``bound`` of ``expected`` everywhere, else where and by how much it is not."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
    error = (got.double() - expected.double()).abs()
    over = error > bound
    if over.any():
        worst = (error - bound).argmax()
        return (
            f"{int(over.sum())} of {got.numel()} off, worst {error.flatten()[worst]:.3g} > {bound.flatten()[worst]:.3g}"
        )
    return None


def check_collapse(case: Case, device: torch.device) -> str | None:
    from dsinfer.ops.mhc.triton import hc_collapse_triton

    inputs = make_inputs(case, device)
    streams, pre = inputs["streams"], inputs["pre"]
    got = hc_collapse_triton(streams, pre)
    expected = hc_collapse_reference(streams, pre)
    magnitude = (pre.double().unsqueeze(-1) * streams.double()).abs().sum(-2)
    bound = 2**-20 * magnitude
    if case.dtype != torch.float32:
        bound = bound + 2**-7 * expected.double().abs()
    message = _excess(got, expected, bound)
    return None if message is None else f"collapse {case}: {message}"


def check_expand(case: Case, device: torch.device) -> str | None:
    from dsinfer.ops.mhc.triton import hc_expand_triton

    inputs = make_inputs(case, device)
    y, streams, post, comb = (inputs[name] for name in ("block_output", "streams", "post", "comb"))
    got = hc_expand_triton(y, streams, post, comb)
    expected = hc_expand_reference(y, streams, post, comb)
    dtype = streams.dtype
    spread = post.to(dtype).double().unsqueeze(-1) * y.double().unsqueeze(-2)
    terms = comb.to(dtype).double().unsqueeze(-1) * streams.double().unsqueeze(-2)  # [..., j, i, D]
    mix = terms.sum(-3)
    bound = 2**-20 * (spread.abs() + terms.abs().sum(-3))
    if case.dtype != torch.float32:
        bound = bound + 2**-8 * (spread.abs() + mix.abs() + (spread + mix).abs() + expected.double().abs())
    message = _excess(got, expected, bound)
    return None if message is None else f"expand {case}: {message}"


def run_interpreted_cases() -> list[str]:
    """Every case through the interpreter (TRITON_INTERPRET=1 must be set before Triton loads)."""
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()
    cpu = torch.device("cpu")
    return [message for case in CASES for message in (check_collapse(case, cpu), check_expand(case, cpu)) if message]


def test_triton_kernels_match_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_mhc")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_triton_kernels_match_reference_on_cuda(case):
    device = torch.device("cuda")
    for message in (check_collapse(case, device), check_expand(case, device)):
        assert message is None, message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
def test_large_prefill_matches_reference_on_cuda():
    """V4 prefill size (16384 tokens x 4 x 4096): int64 offsets and the full grid."""
    case = Case(16384, 4096, 4, torch.bfloat16, seed=7)
    device = torch.device("cuda")
    for message in (check_collapse(case, device), check_expand(case, device)):
        assert message is None, message


def test_registry_picks_reference_on_cpu_and_triton_on_cuda():
    for op in ("hc_collapse", "hc_expand"):
        names = [b.name for b in registry.backends(op)]
        assert names[0] == "triton" and names[-1] == "reference"
        assert registry.choose(op, "cpu", torch.bfloat16).name == "reference"
        if torch.cuda.is_available():
            assert registry.choose(op, "cuda", torch.bfloat16).name == "triton"
    table = registry.resolve("cpu", torch.float32)
    assert table.hc_collapse is hc_collapse_reference and table.hc_expand is hc_expand_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_are_the_validated_expressions(dtype):
    """The layer functions, with or without an op table, compute bit for bit what mhc.py computed before."""
    case = Case(7, 100, 4, dtype, strided=True, seed=3)
    inputs = make_inputs(case, torch.device("cpu"))
    y, streams, pre, post, comb = (inputs[k] for k in ("block_output", "streams", "pre", "post", "comb"))
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)
    spread = post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2)
    expanded = spread + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    table = registry.reference_table("cpu", dtype)
    for ops in (None, table):
        assert torch.equal(collapse_streams(streams, pre, ops), collapsed)
        assert torch.equal(expand_streams(y, streams, post, comb, ops), expanded)
    n, width = 4, 100
    fn, base, scale = torch.randn(n, n * width), torch.randn(n), torch.ones(1)
    assert torch.equal(
        hyper_head(streams, fn, base, scale, 1e-6, 1e-6, table), hyper_head(streams, fn, base, scale, 1e-6, 1e-6)
    )
