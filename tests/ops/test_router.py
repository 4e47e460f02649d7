"""The router's scores and pick (``moe_route``): the Triton kernel (in Triton's CPU interpreter; compiled on CUDA)
against the torch reference, and the reference against the definition.

Expert ids must be equal, in order (ties included: logits rounded to a coarse grid tie often, and the lowest
expert must win as in the reference's packed-key top-k); weights within ``2e-6 |ref| + 1e-7`` (the interpreter's
``log1p`` is not torch's, and the k-term sum may add in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops.router.reference import MoeRouteInputs, moe_route_reference

CASES = [  # (tokens, experts, k, kind: "shared" / "image" / "hash" / "-inf", normalize, ties, gate_temp)
    (1, 256, 6, "shared", True, False, 1.0),
    (7, 256, 6, "shared", True, True, 1.0),
    (5, 384, 6, "image", True, False, 1.0),
    (9, 384, 6, "image", True, True, 1.7),
    (1, 384, 6, "image", True, False, 0.8),
    (3, 64, 1, "shared", False, False, 1.0),
    (3, 64, 1, "image", False, False, 1.3),
    (4, 40, 8, "shared", True, True, 1.0),
    (6, 256, 6, "hash", True, False, 1.0),
    (1, 256, 6, "hash", False, False, 1.5),
    (2, 16, 4, "-inf", True, False, 1.0),  # -inf biases: picked after every finite key, lowest first
    (4, 128, 6, "bf16", True, False, 1.0),  # a bf16 bias (a model cast to bf16): widened exactly
    (0, 256, 6, "shared", True, False, 1.0),
]
VOCAB = 50


def make_inputs(index: int, device: str):
    tokens, experts, k, kind, normalize, ties, gate_temp = CASES[index]
    gen = torch.Generator().manual_seed(index)
    logits = torch.randn(tokens, experts, generator=gen) * 4
    if tokens:
        logits[0, :4] = torch.tensor([25.0, 19.5, -30.0, -90.0])  # softplus's threshold, exp's underflow
    if ties:
        logits = logits.round()
    bias, bias_vl, image_mask, table, ids = None, None, None, None, None
    if kind == "hash":
        table = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(VOCAB)]).int()
        ids = torch.randint(0, VOCAB, (tokens,), generator=gen)
    else:
        bias = torch.zeros(experts) if ties else torch.randn(experts, generator=gen) * 0.1
        if kind == "-inf":
            bias[torch.randperm(experts, generator=gen)[:14]] = float("-inf")
        if kind == "bf16":
            bias = bias.bfloat16()
        if kind == "image":
            bias_vl = torch.randn(experts, generator=gen) * 0.5
            image_mask = torch.rand(tokens, generator=gen) < 0.5
            if tokens > 1:
                image_mask[:2] = torch.tensor([True, False])
    moved = [t.to(device) if t is not None else None for t in (logits, bias, bias_vl, image_mask, table, ids)]
    logits, bias, bias_vl, image_mask, table, ids = moved
    return MoeRouteInputs(logits, gate_temp, bias, bias_vl, image_mask, table, ids, k, normalize, 1.5)


def check(device: str) -> list[str]:
    from dsinfer.ops.router.triton import moe_route_triton, serves

    failures = []
    for index in range(len(CASES)):
        inputs = make_inputs(index, device)
        if not serves(inputs):
            failures.append(f"case {index}: the kernel does not take it")
            continue
        experts, weights = moe_route_triton(inputs)
        want_experts, want_weights = moe_route_reference(inputs)  # the same device: CUDA's arithmetic on CUDA
        if not torch.equal(experts, want_experts):
            failures.append(f"case {index}: experts {experts.tolist()[:2]} != {want_experts.tolist()[:2]}")
        elif not bool(((weights - want_weights).abs() <= 2e-6 * want_weights.abs() + 1e-7).all()):
            failures.append(f"case {index}: weights off by {float((weights - want_weights).abs().max()):.3g}")
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
    logits = torch.log(torch.expm1(scores.double() ** 2)).float()  # softplus(logits).sqrt() = scores (rounded)
    got = F.softplus(logits).sqrt()
    bias = torch.tensor([0.5, 0.0, 0.0, 0.0, -1.0])
    experts, weights = moe_route_reference(MoeRouteInputs(logits, 1.0, bias, None, None, None, None, 3, True, 2.0))
    assert experts.tolist()[0][0] == 0 and sorted(experts.tolist()[0][1:]) == [1, 2]
    assert torch.allclose(weights, got[:, experts[0]] / got[:, experts[0]].sum() * 2.0)
    table = torch.tensor([[0, 1], [4, 3]], dtype=torch.int32)
    experts, weights = moe_route_reference(
        MoeRouteInputs(logits, 1.0, None, None, None, table, torch.tensor([1]), 2, False, 1.0)
    )
    assert experts.tolist() == [[4, 3]] and torch.equal(weights, got[:, [4, 3]])


def test_reference_is_the_routers_torch_chain():
    """Bit for bit the chain the router ran before the op took it: divide, softplus, sqrt, bias choice, pick."""
    from dsinfer.ops.topk import topk_indices

    inputs = make_inputs(3, "cpu")
    logits, gate_temp, k, scaling = inputs.logits, inputs.gate_temp, inputs.k, inputs.scaling
    bias, bias_vl, image_mask = inputs.bias, inputs.bias_vl, inputs.image_mask
    scores = F.softplus(logits / gate_temp).sqrt()
    keys = scores + torch.where(image_mask[:, None], bias_vl.float(), bias.float().expand_as(scores))
    experts = topk_indices(keys, k)
    weights = scores.gather(1, experts)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling
    got_experts, got_weights = moe_route_reference(inputs)
    assert torch.equal(got_experts, experts) and torch.equal(got_weights, weights)
