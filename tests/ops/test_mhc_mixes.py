"""mHC's weight inputs (``hc_mixes``): the Triton kernel (in Triton's CPU interpreter; compiled on CUDA) against the
torch reference, and the reference against the expressions the models were validated with.

Bound: ``|got - ref| <= 1e-5 * sum_k |x_k * r * fn_mk|`` per output, with ``r = rsqrt(mean(x^2) + eps)``, i.e. a
float32-level relative error of the sum of the terms' magnitudes. The kernel sums the unnormalised products and
the squares in its own order (chunks of BLOCK_K columns, partial sums per column split) and scales once; the
reference rounds each normalised element before its GEMM. Each rounding is 2**-24 relative and the sums run over
at most a few hundred chunks, so 1e-5 is a generous float32 bound that TF32 (2**-11) or a missing ``eps`` breaks.
Streams come with per-token magnitudes from 1e-3 (where ``eps`` = 1e-6 is as large as the mean square) to 1e2.

The expected values are computed on the CPU, also for the CUDA cases: a CUDA float32 GEMM may run in TF32.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from interpreted import assert_interpreted_cases_pass

from dsinfer.layers.mhc import hyper_connection_weights, hyper_head
from dsinfer.layers.norm import rms_normalize
from dsinfer.ops import registry
from dsinfer.ops.mhc.reference import hc_mixes_reference
from dsinfer.ops.sinkhorn import sinkhorn_reference

NORM_EPS = 1e-6
RELATIVE = 1e-5


@dataclass(frozen=True)
class Case:
    """Random streams [tokens, n, width] and an [outputs, n * width] float32 ``fn``; ``outputs`` 0 means
    2n + n*n (a block site), else e.g. n (the head); ``strided``: the streams as a non-contiguous view;
    ``lead``: an extra leading axis (tokens split into 2 x tokens/2)."""

    tokens: int
    width: int
    n: int = 4
    outputs: int = 0
    dtype: torch.dtype = torch.float32
    strided: bool = False
    lead: bool = False
    seed: int = 0

    @property
    def m(self) -> int:
        return self.outputs or 2 * self.n + self.n * self.n


CASES = [
    Case(tokens, width, n, outputs, dtype, seed=i)
    for i, (tokens, width, n, outputs, dtype) in enumerate(
        (tokens, width, n, outputs, dtype)
        for tokens in (0, 1, 7, 70)
        for width in (64, 300, 1024)
        for n in (2, 4)
        for outputs in (0, n)
        for dtype in (torch.float32, torch.bfloat16)
    )
] + [
    Case(7, 300, 4, dtype=torch.bfloat16, strided=True, seed=100),
    Case(12, 96, 4, dtype=torch.float32, lead=True, seed=101),
    Case(5, 64, 3, dtype=torch.float16, seed=102),  # n not a power of two, float16 streams
    Case(3, 64, 4, outputs=80, seed=103),  # wider than MAX_M: the backend runs the reference
    Case(9, 0, 4, seed=104),  # an empty width: the reference
]


def make_inputs(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Streams of per-token magnitude 1e-3 .. 1e2 (so ``eps`` matters for the smallest) and an ``fn`` of
    magnitude ~1, as trained projections are."""
    gen = torch.Generator().manual_seed(case.seed)
    t, n, d = case.tokens, case.n, case.width
    magnitude = 10 ** (5 * torch.rand(t, 1, 1, generator=gen) - 3)
    if t:
        magnitude[0] = 1e-3
    streams = (magnitude * torch.randn(t, n, d, generator=gen)).to(case.dtype)
    fn = torch.randn(case.m, n * d, generator=gen)
    if case.strided:
        wide = torch.randn(t, n, 2 * d, generator=gen).to(case.dtype)
        wide[..., ::2] = streams
        streams = wide[..., ::2]
        assert not streams.is_contiguous()
    if case.lead:
        streams = streams.unflatten(0, (2, t // 2))
    return streams.to(device), fn.to(device)


def check_mixes(case: Case, device: torch.device, eps: float = NORM_EPS) -> str | None:
    """None if the Triton backend is within the bound of the reference (computed on the CPU), else why not."""
    from dsinfer.ops.mhc.mixes_triton import hc_mixes_triton

    streams, fn = make_inputs(case, device)
    got = hc_mixes_triton(streams, fn, eps).cpu()
    streams, fn = streams.cpu(), fn.cpu()
    expected = hc_mixes_reference(streams, fn, eps)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"{case}: shape/dtype {tuple(got.shape)} {got.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
    x = streams.flatten(-2).double()
    scale = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    bound = RELATIVE * ((x * scale).abs() @ fn.double().abs().T)
    error = (got.double() - expected.double()).abs()
    over = ~(error <= bound)  # a NaN is over too
    if over.any():
        worst = (error - bound).nan_to_num(float("inf")).argmax()
        flat_error, flat_bound = error.flatten()[worst], bound.flatten()[worst]
        return f"{case}: {int(over.sum())} of {got.numel()} off, worst {flat_error:.3g} > {flat_bound:.3g}"
    return None


def run_interpreted_cases() -> list[str]:
    """Every case through the interpreter (TRITON_INTERPRET=1 must be set before Triton loads)."""
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()
    cpu = torch.device("cpu")
    return [message for message in (check_mixes(case, cpu) for case in CASES) if message]


def test_triton_kernel_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_mhc_mixes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_triton_kernel_matches_reference_on_cuda(case):
    message = check_mixes(case, torch.device("cuda"))
    assert message is None, message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("tokens", [1, 512, 16384])
def test_v4_flash_sizes_match_reference_on_cuda(tokens):
    """V4-Flash width (n=4, D=4096: 16384 columns) at decode, chunked-prefill and prefill sizes: the column
    split, the single-pass grid and int64 offsets."""
    message = check_mixes(Case(tokens, 4096, 4, dtype=torch.bfloat16, seed=7), torch.device("cuda"))
    assert message is None, message


def test_registry_picks_reference_on_cpu_and_triton_on_cuda():
    names = [b.name for b in registry.backends("hc_mixes")]
    assert names[0] == "triton" and names[-1] == "reference"
    assert registry.choose("hc_mixes", "cpu", torch.bfloat16).name == "reference"
    if torch.cuda.is_available():
        assert registry.choose("hc_mixes", "cuda", torch.bfloat16).name == "triton"
    assert registry.resolve("cpu", torch.float32).hc_mixes is hc_mixes_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_validated_expression(dtype):
    """The layer functions, with or without an op table, compute bit for bit what mhc.py computed before."""
    case = Case(7, 100, 4, dtype=dtype, seed=3)
    streams, fn = make_inputs(case, torch.device("cpu"))
    n = case.n
    base, scale = torch.randn(2 * n + n * n), torch.rand(3) + 0.5
    mixes = F.linear(rms_normalize(streams.flatten(-2).float(), NORM_EPS), fn.float())
    assert torch.equal(hc_mixes_reference(streams, fn, NORM_EPS), mixes)

    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + 1e-6
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    logits = comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n)
    comb = sinkhorn_reference(torch.softmax(logits, dim=-1) + 1e-6, 20, 1e-6)
    head_fn, head_base = fn[:n], base[:n]
    head_mixes = F.linear(rms_normalize(streams.flatten(-2).float(), NORM_EPS), head_fn.float())
    head_pre = torch.sigmoid(head_mixes * scale[:1] + head_base) + 1e-6
    head = (head_pre.unsqueeze(-1) * streams).sum(dim=-2).to(dtype)
    table = registry.reference_table("cpu", dtype)
    for ops in (None, table):
        got = hyper_connection_weights(streams, fn, base, scale, 20, 1e-6, NORM_EPS, ops)
        for value, want in zip(got, (pre, post, comb), strict=True):
            assert torch.equal(value, want)
        assert torch.equal(hyper_head(streams, head_fn, head_base, scale[:1], 1e-6, NORM_EPS, ops), head)
