"""A site's input (``hc_site_input``): the Triton backend (in Triton's CPU interpreter; compiled on CUDA) against
the torch reference, which is the mixes, weights and collapse references composed; its two halves (collapse,
weights) in either order give the same bits; and the layer path on the reference against the separate ops it
replaced, bit for bit, whichever half runs first.

Bounds. ``pre``, ``post`` and ``comb``: ``|got - ref| <= 1e-5 * |ref| + 1e-6`` per value, the weights' bound
(tests/ops/test_mhc_weights.py). Here the mixes come from the partial sums rather than the reference's GEMM too,
but with ``fn`` scaled to mixes of magnitude ~1 their float32 error (tests/ops/test_mhc_mixes.py) stays near
1e-7, well inside it. The block input is checked twice:

* against the reference collapse of the streams with the mix the backend collapsed with (its own returned
  ``pre``, or the carried mix): the collapse's bound (tests/ops/test_mhc.py), 2**-20 of the sum of the terms'
  magnitudes plus, below float32, one unit in the last place (2**-7 of the result). This shows the kernel
  collapses with the very ``pre`` it returns;
* against the full reference: that bound plus the weights' bound carried through the sum,
  ``sum_j (1e-5 * pre_j + 1e-6) * |stream_j|``.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.layers.mhc import collapse_streams, hyper_connection_weights, site_input
from dsinfer.ops import registry
from dsinfer.ops.mhc.reference import HcSiteInputs, hc_collapse_reference, hc_site_input_reference

HC_EPS = 1e-6
NORM_EPS = 1e-6
ITERATIONS = 20


@dataclass(frozen=True)
class Case:
    """Random site inputs: ``tokens`` x ``n`` streams of ``width``; ``carried``: a V4.1 carried mix; ``lead``:
    an extra leading axis (tokens split into 2 x tokens/2). With n = 4, a width of 64 (256 columns) is the one
    the mixes do not split at these token counts: the backend runs the three separate ops."""

    tokens: int
    width: int
    n: int = 4
    dtype: torch.dtype = torch.float32
    carried: bool = False
    lead: bool = False
    seed: int = 0


CASES = [
    Case(tokens, width, 4, dtype, carried, seed=i)
    for i, (tokens, width, dtype, carried) in enumerate(
        (tokens, width, dtype, carried)
        for tokens in (1, 3, 17)
        for width in (256, 300, 64)  # 300: not a multiple of any column block; 64: no column split
        for dtype in (torch.float32, torch.bfloat16)
        for carried in (False, True)
    )
] + [
    Case(0, 256, seed=100),  # no tokens
    Case(12, 256, dtype=torch.bfloat16, carried=True, lead=True, seed=101),
    Case(5, 256, dtype=torch.float16, seed=102),
    Case(4, 128, n=2, dtype=torch.bfloat16, seed=103),
]


def make_inputs(case: Case, device: torch.device) -> dict:
    """Streams of a few units, an ``fn`` scaled to mixes of magnitude ~1 (RMS-normalised streams projected by a
    trained-like projection), trained-like ``base`` and ``scale``, and a carried mix in (0, 1] if asked."""
    gen = torch.Generator().manual_seed(case.seed)
    t, n, d = case.tokens, case.n, case.width
    m = 2 * n + n * n
    inputs = {
        "streams": (3 * torch.randn(t, n, d, generator=gen)).to(case.dtype),
        "fn": torch.randn(m, n * d, generator=gen) / (n * d) ** 0.5,
        "base": torch.randn(m, generator=gen),
        "scale": torch.rand(3, generator=gen) * 2 + 0.1,
        "carried_mix": torch.rand(t, n, generator=gen) + 1e-6 if case.carried else None,
    }
    if case.lead:
        for name in ("streams", "carried_mix"):
            if inputs[name] is not None:
                inputs[name] = inputs[name].unflatten(0, (2, t // 2))
    return {name: None if value is None else value.to(device) for name, value in inputs.items()}


def _excess(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor) -> str | None:
    """None if ``got`` is within ``bound`` of ``expected`` everywhere (and of its shape and dtype), else why not."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
    error = (got.double() - expected.double()).abs()
    over = ~(error <= bound)  # a NaN is over too
    if over.any():
        worst = (error - bound).nan_to_num(float("inf")).argmax()
        return (
            f"{int(over.sum())} of {got.numel()} off, worst {error.flatten()[worst]:.3g} > {bound.flatten()[worst]:.3g}"
        )
    return None


def _collapse_runs_weights(parts) -> bool:
    """Whether ``parts.collapse()`` ran the weights' work: it must not, since that work may run on another stream
    (``beside``), where a collapse that read its ``pre`` would race it."""
    pending = parts.weights_pending
    parts.collapse()
    return pending and not parts.weights_pending


def check_site(case: Case, device: torch.device) -> list[str]:
    """The Triton backend on ``device`` against the reference on the CPU (a CUDA float32 GEMM may run in TF32)."""
    from dsinfer.ops.mhc.site_triton import hc_site_input_triton

    inputs = make_inputs(case, device)
    args = (inputs["streams"], inputs["fn"], inputs["base"], inputs["scale"], ITERATIONS, HC_EPS, NORM_EPS)
    site = HcSiteInputs(*args, inputs["carried_mix"])
    got = [value.cpu() for value in hc_site_input_triton(site).all()]
    parts = hc_site_input_triton(site)  # the halves the other way round: the same bits
    weights_first = [value.cpu() for value in (*parts.weights(), parts.collapse())]
    parts = hc_site_input_triton(site)
    collapse_ran_weights = _collapse_runs_weights(parts)
    inputs = {name: None if value is None else value.cpu() for name, value in inputs.items()}
    streams, carried = inputs["streams"], inputs["carried_mix"]
    args = (streams, inputs["fn"], inputs["base"], inputs["scale"], ITERATIONS, HC_EPS, NORM_EPS)
    expected = hc_site_input_reference(HcSiteInputs(*args, carried)).all()
    failures = []
    if collapse_ran_weights:
        failures.append(f"{case}: the collapse ran the weights' work (a race where they run on another stream)")
    if not all(torch.equal(a, b) for a, b in zip(got, weights_first[3:] + weights_first[:3], strict=True)):
        failures.append(f"{case}: the weights first give other bits than the collapse first")
    for name, value, want in zip(("pre", "post", "comb"), got[1:], expected[1:], strict=True):
        message = _excess(value, want, 1e-5 * want.double().abs() + 1e-6)
        if message:
            failures.append(f"{case} {name}: {message}")

    mix = got[1] if carried is None else carried  # what the backend collapsed with
    wide = streams.double()
    collapse_bound = 2**-20 * (mix.double().unsqueeze(-1) * wide).abs().sum(-2)
    if case.dtype != torch.float32:
        collapse_bound = collapse_bound + 2**-7 * expected[0].double().abs()
    message = _excess(got[0], hc_collapse_reference(streams, mix), collapse_bound)
    if message:
        failures.append(f"{case} collapse with its own mix: {message}")
    weights_error = torch.zeros_like(collapse_bound)
    if carried is None:
        weights_error = ((1e-5 * expected[1].double() + 1e-6).unsqueeze(-1) * wide.abs()).sum(-2)
    message = _excess(got[0], expected[0], collapse_bound + weights_error)
    if message:
        failures.append(f"{case} collapse: {message}")
    return failures


def check_unsplit_runs_the_separate_backends() -> list[str]:
    """Without a column split the backend's answer is the three backends' in sequence, exactly."""
    from dsinfer.ops.mhc.mixes_triton import hc_mixes_triton, plan_for
    from dsinfer.ops.mhc.site_triton import hc_site_input_triton
    from dsinfer.ops.mhc.triton import hc_collapse_triton
    from dsinfer.ops.mhc.weights_triton import hc_weights_triton

    inputs = make_inputs(Case(3, 64, dtype=torch.bfloat16, seed=200), torch.device("cpu"))
    streams, fn = inputs["streams"], inputs["fn"]
    if plan_for(streams, fn)[1] != 1:
        return ["the unsplit case splits"]
    site = HcSiteInputs(streams, fn, inputs["base"], inputs["scale"], ITERATIONS, HC_EPS, NORM_EPS)
    got = hc_site_input_triton(site).all()
    mixes = hc_mixes_triton(streams, fn, NORM_EPS)
    weights = hc_weights_triton(mixes, inputs["base"], inputs["scale"], ITERATIONS, HC_EPS)
    expected = (hc_collapse_triton(streams, weights[0]), *weights)
    if not all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)):
        return ["the unsplit case differs from the separate backends"]
    return []


def run_interpreted_cases() -> list[str]:
    """Every case through the interpreter (TRITON_INTERPRET=1 must be set before Triton loads)."""
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()
    cpu = torch.device("cpu")
    return [message for case in CASES for message in check_site(case, cpu)] + check_unsplit_runs_the_separate_backends()


def test_triton_backend_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_mhc_site")


def test_cases_cover_split_and_unsplit_plans():
    """The cases reach both branches of the backend: the fused kernel and the separate ops."""
    pytest.importorskip("triton")
    from dsinfer.ops.mhc.mixes_triton import plan_for

    splits = {
        plan_for(*(make_inputs(c, torch.device("cpu"))[k] for k in ("streams", "fn")))[1] > 1 for c in CASES if c.tokens
    }
    assert splits == {True, False}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_triton_backend_matches_reference_on_cuda(case):
    assert check_site(case, torch.device("cuda")) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("carried", [False, True])
@pytest.mark.parametrize("tokens", [1, 32])
def test_v4_widths_match_reference_on_cuda(tokens, carried):
    """V4 widths (n = 4, D = 4096: a 64-way column split at one token) at decode sizes, bf16 streams."""
    assert check_site(Case(tokens, 4096, 4, torch.bfloat16, carried, seed=7), torch.device("cuda")) == []


def test_inputs_the_kernel_does_not_take_go_to_the_reference():
    """n = 3 (not a power of two) and a bf16 carried mix: the backend's answer is the reference's, exactly."""
    from dsinfer.ops.mhc.site_triton import hc_site_input_triton

    for case, cast in ((Case(4, 64, n=3, seed=300), False), (Case(4, 256, carried=True, seed=301), True)):
        inputs = make_inputs(case, torch.device("cpu"))
        if cast:
            inputs["carried_mix"] = inputs["carried_mix"].bfloat16()
        args = tuple(inputs[k] for k in ("streams", "fn", "base", "scale"))
        site = HcSiteInputs(*args, ITERATIONS, HC_EPS, NORM_EPS, inputs["carried_mix"])
        got = hc_site_input_triton(site).all()
        expected = hc_site_input_reference(site).all()
        for value, want in zip(got, expected, strict=True):
            assert torch.equal(value, want)


def test_registry_picks_reference_on_cpu_and_triton_on_cuda():
    names = [b.name for b in registry.backends("hc_site_input")]
    assert names[0] == "triton" and names[-1] == "reference"
    assert registry.choose("hc_site_input", "cpu", torch.bfloat16).name == "reference"
    if torch.cuda.is_available():
        assert registry.choose("hc_site_input", "cuda", torch.bfloat16).name == "triton"
    assert registry.resolve("cpu", torch.float32).hc_site_input is hc_site_input_reference


@pytest.mark.parametrize("carried", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_path_is_the_separate_ops_bit_for_bit(dtype, carried):
    """``site_input``, with or without an op table, computes exactly what the layer computed before the op:
    the weights, then the collapse with ``pre`` or the carried mix."""
    inputs = make_inputs(Case(7, 100, 4, dtype, carried, seed=3), torch.device("cpu"))
    streams, fn, base, scale, carried_mix = (inputs[k] for k in ("streams", "fn", "base", "scale", "carried_mix"))
    pre, post, comb = hyper_connection_weights(streams, fn, base, scale, ITERATIONS, HC_EPS, NORM_EPS)
    collapsed = collapse_streams(streams, pre if carried_mix is None else carried_mix)
    for ops in (None, registry.reference_table("cpu", dtype)):
        for weights_first in (False, True):
            site = HcSiteInputs(streams, fn, base, scale, ITERATIONS, HC_EPS, NORM_EPS, carried_mix)
            parts = site_input(site, ops)
            if weights_first:
                parts.weights()
            got = parts.all()
            for value, want in zip(got, (collapsed, pre, post, comb), strict=True):
                assert torch.equal(value, want)
            assert parts.collapse() is got[0] and parts.weights()[0] is got[1]  # each half runs once
            assert not _collapse_runs_weights(site_input(site, ops))
