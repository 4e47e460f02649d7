"""mHC's Sinkhorn: the Triton kernel (in Triton's CPU interpreter) against the torch reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dsinfer.ops.sinkhorn.reference import sinkhorn_reference

# Run in a fresh interpreter with TRITON_INTERPRET=1 set before Triton loads, so its reductions (tl.sum is
# itself a Triton function) are interpreted too.
_CHECK = """
import torch
import dsinfer.ops.sinkhorn.triton as backend
from dsinfer.ops.sinkhorn.reference import sinkhorn_reference
for tokens in (1, 63, 130):
    for iterations in (1, 20):
        generator = torch.Generator().manual_seed(tokens)
        comb = torch.softmax(torch.randn(tokens, 4, 4, generator=generator) * 3, dim=-1) + 1e-6
        expected = sinkhorn_reference(comb, iterations, 1e-6)
        got = backend.sinkhorn_triton(comb, iterations, 1e-6)
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-7), (tokens, iterations, (got - expected).abs().max())
print("ok")
"""


def test_reference_is_doubly_stochastic():
    comb = torch.rand(5, 4, 4) + 0.01
    out = sinkhorn_reference(comb, 20, 1e-6)
    assert torch.allclose(out.sum(-2), torch.ones(5, 4), atol=1e-5)
    assert torch.allclose(out.sum(-1), torch.ones(5, 4), atol=1e-3)


def test_triton_kernel_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
