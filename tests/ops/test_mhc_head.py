"""V4's last collapse (``hc_head``): the Triton backend (in Triton's CPU interpreter; compiled on CUDA) against the
torch reference, which is the mixes and collapse references around the head's weights; the layer path on the
reference against the expression it replaced, bit for bit.

Bounds, as the site's (tests/ops/test_mhc_site.py): the weights ``pre`` are not returned, so the hidden state is
checked against the full reference with the collapse's bound (2**-20 of the sum of the terms' magnitudes plus,
below float32, one unit in the last place) plus the weights' bound carried through the sum,
``sum_j (1e-5 * pre_j + 1e-6) * |stream_j|``, with ``fn`` scaled to mixes of magnitude ~1.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from interpreted import assert_interpreted_cases_pass
from test_mhc_site import _excess

from dsinfer.layers.mhc import collapse_streams, hyper_head
from dsinfer.ops import registry
from dsinfer.ops.mhc.reference import hc_head_reference, hc_mixes_reference, head_pre

HC_EPS = 1e-6
NORM_EPS = 1e-6


@dataclass(frozen=True)
class Case:
    """Random head inputs: ``tokens`` x ``n`` streams of ``width``; ``lead``: tokens as 2 x tokens/2. With n = 4,
    a width of 64 (256 columns) is one the mixes do not split at these token counts."""

    tokens: int
    width: int
    n: int = 4
    dtype: torch.dtype = torch.float32
    lead: bool = False
    seed: int = 0


CASES = [
    Case(tokens, width, 4, dtype, seed=i)
    for i, (tokens, width, dtype) in enumerate(
        (tokens, width, dtype)
        for tokens in (1, 3, 17)
        for width in (256, 300, 64)  # 300: not a multiple of any column block; 64: no column split
        for dtype in (torch.float32, torch.bfloat16)
    )
] + [
    Case(0, 256, seed=100),  # no tokens
    Case(12, 256, dtype=torch.bfloat16, lead=True, seed=101),
    Case(5, 256, dtype=torch.float16, seed=102),
    Case(4, 128, n=2, dtype=torch.bfloat16, seed=103),
]


def make_inputs(case: Case, device: torch.device) -> dict:
    """Streams of a few units, an ``fn`` scaled to mixes of magnitude ~1, trained-like ``base`` and ``scale``."""
    gen = torch.Generator().manual_seed(case.seed)
    t, n, d = case.tokens, case.n, case.width
    streams = (3 * torch.randn(t, n, d, generator=gen)).to(case.dtype)
    if case.lead:
        streams = streams.unflatten(0, (2, t // 2))
    inputs = {
        "streams": streams,
        "fn": torch.randn(n, n * d, generator=gen) / (n * d) ** 0.5,
        "base": torch.randn(n, generator=gen),
        "scale": torch.rand(1, generator=gen) * 2 + 0.1,
    }
    return {name: value.to(device) for name, value in inputs.items()}


def check_head(case: Case, device: torch.device) -> list[str]:
    """The Triton backend on ``device`` against the reference on the CPU (a CUDA float32 GEMM may run in TF32)."""
    from dsinfer.ops.mhc.head_triton import hc_head_triton

    inputs = make_inputs(case, device)
    args = (inputs["streams"], inputs["fn"], inputs["base"], inputs["scale"], HC_EPS, NORM_EPS)
    got = hc_head_triton(*args).cpu()
    inputs = {name: value.cpu() for name, value in inputs.items()}
    streams = inputs["streams"]
    expected = hc_head_reference(streams, inputs["fn"], inputs["base"], inputs["scale"], HC_EPS, NORM_EPS)
    mixes = hc_mixes_reference(streams, inputs["fn"], NORM_EPS)
    pre = head_pre(mixes, inputs["base"], inputs["scale"], HC_EPS)
    wide = streams.double()
    bound = 2**-20 * (pre.double().unsqueeze(-1) * wide).abs().sum(-2)
    if case.dtype != torch.float32:
        bound = bound + 2**-7 * expected.double().abs()
    bound = bound + ((1e-5 * pre.double() + 1e-6).unsqueeze(-1) * wide.abs()).sum(-2)
    message = _excess(got, expected, bound)
    return [f"{case}: {message}"] if message else []


def check_unsplit_runs_the_separate_backends() -> list[str]:
    """Without a column split the backend's answer is the mixes and collapse backends' around the head's weights."""
    from dsinfer.ops.mhc.head_triton import hc_head_triton
    from dsinfer.ops.mhc.mixes_triton import hc_mixes_triton, plan_for
    from dsinfer.ops.mhc.triton import hc_collapse_triton

    inputs = make_inputs(Case(3, 64, dtype=torch.bfloat16, seed=200), torch.device("cpu"))
    streams, fn, base, scale = (inputs[k] for k in ("streams", "fn", "base", "scale"))
    if plan_for(streams, fn)[1] != 1:
        return ["the unsplit case splits"]
    got = hc_head_triton(streams, fn, base, scale, HC_EPS, NORM_EPS)
    expected = hc_collapse_triton(streams, head_pre(hc_mixes_triton(streams, fn, NORM_EPS), base, scale, HC_EPS))
    return [] if torch.equal(got, expected) else ["the unsplit case differs from the separate backends"]


def run_interpreted_cases() -> list[str]:
    """Every case through the interpreter (TRITON_INTERPRET=1 must be set before Triton loads)."""
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()
    cpu = torch.device("cpu")
    return [message for case in CASES for message in check_head(case, cpu)] + check_unsplit_runs_the_separate_backends()


def test_triton_backend_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_mhc_head")


def test_cases_cover_split_and_unsplit_plans():
    """The cases reach both branches of the backend: the site kernel's collapse and the separate ops."""
    pytest.importorskip("triton")
    from dsinfer.ops.mhc.mixes_triton import plan_for

    splits = {
        plan_for(*(make_inputs(c, torch.device("cpu"))[k] for k in ("streams", "fn")))[1] > 1 for c in CASES if c.tokens
    }
    assert splits == {True, False}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_triton_backend_matches_reference_on_cuda(case):
    assert check_head(case, torch.device("cuda")) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("tokens", [1, 32])
def test_v4_widths_match_reference_on_cuda(tokens):
    """V4 widths (n = 4, D = 4096: a 64-way column split at one token) at decode sizes, bf16 streams."""
    assert check_head(Case(tokens, 4096, 4, torch.bfloat16, seed=7), torch.device("cuda")) == []


def test_inputs_the_kernel_does_not_take_go_to_the_reference():
    """n = 3 (not a power of two) and an ``fn`` of other rows than n: the backend's answer is the reference's."""
    from dsinfer.ops.mhc.head_triton import hc_head_triton

    inputs = make_inputs(Case(4, 64, n=3, seed=300), torch.device("cpu"))
    args = tuple(inputs[k] for k in ("streams", "fn", "base", "scale"))
    assert torch.equal(hc_head_triton(*args, HC_EPS, NORM_EPS), hc_head_reference(*args, HC_EPS, NORM_EPS))
    inputs = make_inputs(Case(4, 64, seed=301), torch.device("cpu"))
    streams, fn, base, scale = (inputs[k] for k in ("streams", "fn", "base", "scale"))
    wide_fn = torch.cat([fn, fn[:1]])  # five rows for four streams: the mixes' reference takes it, the head not
    with pytest.raises(RuntimeError):
        hc_head_triton(streams, wide_fn, base, scale, HC_EPS, NORM_EPS)  # the reference's own error, unchanged


def test_registry_picks_reference_on_cpu_and_triton_on_cuda():
    names = [b.name for b in registry.backends("hc_head")]
    assert names[0] == "triton" and names[-1] == "reference"
    assert registry.choose("hc_head", "cpu", torch.bfloat16).name == "reference"
    if torch.cuda.is_available():
        assert registry.choose("hc_head", "cuda", torch.bfloat16).name == "triton"
    assert registry.resolve("cpu", torch.float32).hc_head is hc_head_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_path_is_the_expression_it_replaced_bit_for_bit(dtype):
    """``hyper_head``, with or without an op table, computes exactly what V4's head computed before the op: the
    mixes, the sigmoid of the scaled and biased mixes plus ``hc_eps``, the collapse."""
    inputs = make_inputs(Case(7, 100, 4, dtype, seed=3), torch.device("cpu"))
    streams, fn, base, scale = (inputs[k] for k in ("streams", "fn", "base", "scale"))
    mixes = hc_mixes_reference(streams, fn, NORM_EPS)
    expected = collapse_streams(streams, torch.sigmoid(mixes * scale.float() + base.float()) + HC_EPS)
    for ops in (None, registry.reference_table("cpu", dtype)):
        assert torch.equal(hyper_head(streams, fn, base, scale, HC_EPS, NORM_EPS, ops), expected)
