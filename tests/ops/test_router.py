"""The router's pick (``moe_route``): the Triton kernel (in Triton's CPU interpreter; compiled on CUDA) against the
torch reference, and the reference against the definition.

Expert ids must be equal, in order (ties included: scores rounded to a coarse grid tie often, and the lowest
expert must win as in the reference's packed-key top-k); weights within ``1e-6 |ref| + 1e-7`` (the k-term sum
may add in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops.router.reference import moe_route_reference

CASES = [  # (tokens, experts, k, bias: "shared" / "per-token" / "fixed", normalize, ties)
    (1, 256, 6, "shared", True, False),
    (7, 256, 6, "shared", True, True),
    (5, 384, 6, "per-token", True, False),
    (3, 64, 1, "shared", False, False),
    (4, 40, 8, "shared", True, True),
    (6, 256, 6, "fixed", True, False),
    (2, 16, 4, "shared", True, False),  # -inf biases: picked after every finite key, lowest first
    (0, 256, 6, "shared", True, False),
]


def make_inputs(index: int, device: str):
    tokens, experts, k, kind, normalize, ties = CASES[index]
    gen = torch.Generator().manual_seed(index)
    scores = F.softplus(torch.randn(tokens, experts, generator=gen)).sqrt()
    if ties:
        scores = (scores * 4).round() / 4
    bias, fixed = None, None
    if kind == "shared":
        bias = torch.randn(experts, generator=gen) * 0.1
        if ties:
            bias = torch.zeros(experts)
        if experts == 16:
            bias[torch.randperm(experts, generator=gen)[:14]] = float("-inf")
    elif kind == "per-token":
        bias = torch.randn(tokens, experts, generator=gen) * 0.1
    else:
        fixed = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]).int()
    moved = [t.to(device) if t is not None else None for t in (scores, bias, fixed)]
    return (*moved, k, normalize, 1.5)


def check(device: str) -> list[str]:
    from dsinfer.ops.router.triton import moe_route_triton

    failures = []
    for index in range(len(CASES)):
        args = make_inputs(index, device)
        experts, weights = moe_route_triton(*args)
        ref_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
        want_experts, want_weights = moe_route_reference(*ref_args)
        if not torch.equal(experts.cpu(), want_experts):
            failures.append(f"case {index}: experts {experts.cpu().tolist()[:2]} != {want_experts.tolist()[:2]}")
        elif not bool(((weights.cpu() - want_weights).abs() <= 1e-6 * want_weights.abs() + 1e-7).all()):
            failures.append(f"case {index}: weights off by {float((weights.cpu() - want_weights).abs().max()):.3g}")
    return failures


def run_interpreted_cases() -> list[str]:
    return check("cpu")


def test_triton_kernel_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_router")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
def test_triton_kernel_matches_reference_on_cuda():
    assert check("cuda") == []


def test_reference_picks_the_best_biased_scores_and_weighs_by_the_unbiased_ones():
    scores = torch.tensor([[0.5, 0.9, 0.9, 0.1, 0.7]])
    bias = torch.tensor([0.5, 0.0, 0.0, 0.0, -1.0])
    experts, weights = moe_route_reference(scores, bias, None, 3, True, 2.0)
    assert experts.tolist() == [[0, 1, 2]]  # 1.0, then the tie 0.9 / 0.9 lowest first
    assert torch.allclose(weights, torch.tensor([[0.5, 0.9, 0.9]]) / 2.3 * 2.0)
    fixed = torch.tensor([[4, 3]], dtype=torch.int32)
    experts, weights = moe_route_reference(scores, None, fixed, 2, False, 1.0)
    assert experts.tolist() == [[4, 3]] and torch.allclose(weights, torch.tensor([[0.7, 0.1]]))
