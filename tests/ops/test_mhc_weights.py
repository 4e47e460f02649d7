"""mHC's weights (``hc_weights``): the Triton kernel (in Triton's CPU interpreter; compiled on CUDA) against the
torch reference, and the reference against the expressions the layer computed before the op existed.

Bound: ``|got - ref| <= 1e-5 * |ref| + 1e-6`` per value: float32 rounding (Triton's ``exp`` and the order of the
n-element sums may differ from torch's in the last bit, and twenty Sinkhorn rounds carry it along); a wrong
scale, bias, eps or iteration count is off by far more.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dsinfer.ops import registry
from dsinfer.ops.mhc.reference import hc_weights_reference, streams_of_mixes
from dsinfer.ops.sinkhorn import sinkhorn_reference

EPS = 1e-6
CASES = [  # (leading shape, n, iterations)
    ((0,), 4, 20),
    ((1,), 4, 20),
    ((33,), 4, 20),
    ((70,), 2, 20),
    ((2, 9), 4, 20),
    ((5,), 4, 1),
]


def make_inputs(lead: tuple[int, ...], n: int, seed: int, device: str = "cpu"):
    """Mixes of magnitude ~1 (an RMS-normalised projection), trained-like scales and biases."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * n + n * n
    mixes = torch.randn(*lead, width, generator=gen)
    base = torch.randn(width, generator=gen)
    scale = torch.rand(3, generator=gen) * 2 + 0.1
    return mixes.to(device), base.to(device), scale.to(device)


def check(device: str) -> list[str]:
    """Every case through the Triton backend on ``device`` against the reference on the CPU; the failures."""
    from dsinfer.ops.mhc.weights_triton import hc_weights_triton

    failures = []
    for seed, (lead, n, iterations) in enumerate(CASES):
        mixes, base, scale = make_inputs(lead, n, seed, device)
        got = hc_weights_triton(mixes, base, scale, iterations, EPS)
        expected = hc_weights_reference(mixes.cpu(), base.cpu(), scale.cpu(), iterations, EPS)
        for name, value, want in zip(("pre", "post", "comb"), got, expected, strict=True):
            value = value.cpu()
            if value.shape != want.shape or value.dtype != want.dtype:
                failures.append(f"{lead} n={n} {name}: {tuple(value.shape)} {value.dtype}, want {tuple(want.shape)}")
            elif not bool(((value - want).abs() <= 1e-5 * want.abs() + 1e-6).all()):
                failures.append(f"{lead} n={n} {name}: off by {float((value - want).abs().max()):.3g}")
    return failures


_INTERPRETED = """
import sys
sys.path.insert(0, {tests!r})
from test_mhc_weights import check
failures = check("cpu")
print("ok" if not failures else "\\n".join(failures))
"""


def test_triton_kernel_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # set before Triton loads: a fresh interpreter
    script = _INTERPRETED.format(tests=os.path.dirname(__file__))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", (result.stdout + result.stderr)[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
def test_triton_kernel_matches_reference_on_cuda():
    assert check("cuda") == []


def test_reference_is_the_layers_former_expression():
    """Bit for bit what ``hyper_connection_weights`` computed inline (the validated model code)."""
    n, iterations = 4, 20
    mixes, base, scale = make_inputs((7,), n, seed=3)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + EPS
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    logits = comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n)
    comb = sinkhorn_reference(torch.softmax(logits, dim=-1) + EPS, iterations, EPS)
    for got, want in zip(hc_weights_reference(mixes, base, scale, iterations, EPS), (pre, post, comb), strict=True):
        assert torch.equal(got, want)


def test_mixes_width_names_the_stream_count():
    assert [streams_of_mixes(2 * n + n * n) for n in (1, 2, 3, 4, 8)] == [1, 2, 3, 4, 8]
    with pytest.raises(ValueError, match="2n \\+ n\\*n"):
        streams_of_mixes(10)


def test_shapes_the_kernel_does_not_take_go_to_the_reference():
    """n = 3 (not a power of two) and bf16 mixes: the backend's answer is the reference's, exactly."""
    from dsinfer.ops.mhc.weights_triton import hc_weights_triton

    for mixes, base, scale in (make_inputs((4,), 3, seed=5), make_inputs((4,), 4, seed=6)):
        mixes = mixes if mixes.shape[-1] == 15 else mixes.bfloat16()
        got = hc_weights_triton(mixes, base, scale, 20, EPS)
        for value, want in zip(got, hc_weights_reference(mixes, base, scale, 20, EPS), strict=True):
            assert torch.equal(value, want)


def test_registry_picks_reference_on_cpu():
    names = [b.name for b in registry.backends("hc_weights")]
    assert names[0] == "triton" and names[-1] == "reference"
    assert registry.choose("hc_weights", "cpu", torch.float32).name == "reference"
    if torch.cuda.is_available():
        assert registry.choose("hc_weights", "cuda", torch.bfloat16).name == "triton"
