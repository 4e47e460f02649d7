"""``router_logits``: the weight's bf16 parts sum to it exactly, the parts' GEMM equals the float32 reference up to
the order of float32 sums (emulated on the CPU, compiled on CUDA), and float32 inputs keep the reference."""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops.router_logits.reference import bf16_parts, router_logits_reference


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 256, generator=gen).bfloat16()
    weight = torch.randn(48, 256, generator=gen) * 0.02
    return x, weight


def test_parts_sum_to_the_weight_exactly():
    _, weight = _inputs()
    parts = bf16_parts(weight).float().view(3, *weight.shape)
    assert torch.equal((parts[0] + parts[1]) + parts[2], weight)
    bf16 = weight.bfloat16()
    assert bf16_parts(bf16) is bf16  # a bf16 weight is its own part


def test_parts_products_give_the_float32_logits():
    x, weight = _inputs(1)
    parts = (x.float() @ bf16_parts(weight).float().t()).view(x.shape[0], 3, -1)
    got = (parts[:, 0] + parts[:, 1]) + parts[:, 2]
    want = router_logits_reference(x, weight, None)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tensor_core_backend_matches_reference_on_cuda():
    from dsinfer.ops.router_logits.split_mm import router_logits_split

    x, weight = (t.cuda() for t in _inputs(2))
    want = router_logits_reference(x, weight, None)
    got = router_logits_split(x, weight, bf16_parts(weight))
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    x32 = x.float()
    assert torch.equal(router_logits_split(x32, weight, bf16_parts(weight)), router_logits_reference(x32, weight, None))
