"""Top-k with exact ties broken by the lowest index: every backend against the stable-sort reference."""

from __future__ import annotations

import pytest
import torch

from dsinfer.ops.registry import backends

BACKENDS = [b for b in backends("topk_indices") if b.serves(torch.device("cpu"), torch.float32)]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("width", [1, 7, 64, 513])
def test_ties_go_to_the_lowest_index(backend, width):
    generator = torch.Generator().manual_seed(width)
    # Few distinct values: many exact ties, zeros of both signs, -inf for masked entries.
    scores = torch.randint(-2, 3, (9, width), generator=generator).float()
    scores[scores == -2] = float("-inf")
    scores[:, 0] = -0.0
    for k in sorted({0, 1, min(4, width), width // 2, width}):
        expected = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(backend.fn(scores, k), expected)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_random_floats_match_torch_topk_values(backend):
    scores = torch.randn(5, 300, dtype=torch.float64).to(torch.bfloat16)
    chosen = backend.fn(scores, 17)
    assert torch.equal(scores.gather(-1, chosen), scores.topk(17, dim=-1).values)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_a_selection_does_not_depend_on_the_width_it_was_made_over(backend):
    """The same leading entries pick the same winners however many masked entries follow them."""
    scores = torch.zeros(3, 40)
    scores[:, 5] = 1.0
    narrow = backend.fn(scores[:, :12], 4)
    wide = backend.fn(torch.cat([scores[:, :12], torch.full((3, 500), float("-inf"))], dim=1), 4)
    assert torch.equal(narrow, wide)
    assert narrow[0].tolist() == [5, 0, 1, 2]


def test_k_outside_the_row_is_an_error():
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="k=5"):
            backend.fn(torch.zeros(2, 4), 5)
