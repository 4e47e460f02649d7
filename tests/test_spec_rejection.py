"""Rejection sampling keeps the target distribution: chi-square tests on a tiny vocabulary, synthetic p and q."""

from __future__ import annotations

import torch

from dsinfer.speculative.rejection import greedy_accept, rejection_sample

VOCAB = 6
TRIALS = 200_000
CHI2_CRITICAL = 20.52  # chi-square, 5 degrees of freedom, 0.999 quantile


def _chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=VOCAB).double()
    expected = probs.double() / probs.sum() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def _distributions(generator: torch.Generator, rows: int) -> torch.Tensor:
    return torch.rand(rows, VOCAB, generator=generator).pow(2) + 0.02


def _emitted(draft_ids, accepted, last, position):
    """Token ``position`` of each trial's output (valid where at least ``position`` drafts were accepted)."""
    return torch.where(accepted > position, draft_ids[:, min(position, draft_ids.shape[1] - 1)], last)


def test_sampled_drafts_keep_the_target_distribution_at_each_position():
    generator = torch.Generator().manual_seed(0)
    p = _distributions(generator, 3)  # target rows for positions 0, 1 and the bonus
    q = _distributions(generator, 2)  # draft rows for the two drafts
    q_norm = q / q.sum(-1, keepdim=True)
    draft_ids = torch.stack([torch.multinomial(q_norm[j], TRIALS, True, generator=generator) for j in range(2)], 1)
    uniforms = torch.rand(TRIALS, 2, generator=generator)
    noise = -torch.rand(TRIALS, VOCAB, generator=generator).log()
    accepted, last = rejection_sample(p.expand(TRIALS, -1, -1), draft_ids, uniforms, noise, q.expand(TRIALS, -1, -1))
    first = _emitted(draft_ids, accepted, last, 0)
    assert _chi_square(first, p[0]) < CHI2_CRITICAL
    assert _chi_square(first, q[0]) > 100 * CHI2_CRITICAL  # the test can tell the draft distribution apart
    # Given the first draft was accepted, the second token follows the second target row.
    reached = accepted >= 1
    second = _emitted(draft_ids[reached], accepted[reached], last[reached], 1)
    assert _chi_square(second, p[1]) < CHI2_CRITICAL
    # Given both were accepted, the bonus token follows the last target row.
    both = accepted == 2
    assert _chi_square(last[both], p[2]) < CHI2_CRITICAL
    # Acceptance of the first draft happens with probability sum(min(p, q)).
    expected_rate = torch.minimum(p[0] / p[0].sum(), q_norm[0]).sum()
    assert abs(float(reached.double().mean()) - float(expected_rate)) < 0.005


def test_argmax_drafts_keep_the_target_distribution():
    generator = torch.Generator().manual_seed(1)
    p = _distributions(generator, 2)
    draft = int(_distributions(generator, 1).argmax())  # a deterministic drafter: one-hot q
    draft_ids = torch.full((TRIALS, 1), draft)
    uniforms = torch.rand(TRIALS, 1, generator=generator)
    noise = -torch.rand(TRIALS, VOCAB, generator=generator).log()
    accepted, last = rejection_sample(p.expand(TRIALS, -1, -1), draft_ids, uniforms, noise)
    first = _emitted(draft_ids, accepted, last, 0)
    assert _chi_square(first, p[0]) < CHI2_CRITICAL
    assert abs(float(accepted.double().mean()) - float(p[0, draft] / p[0].sum())) < 0.005


def test_greedy_accept_counts_the_leading_matches():
    assert greedy_accept(torch.tensor([4, 5, 6, 7]), torch.tensor([4, 5, 9])) == 2
    assert greedy_accept(torch.tensor([4, 5, 6, 7]), torch.tensor([4, 5, 6])) == 3
    assert greedy_accept(torch.tensor([4, 5]), torch.tensor([3])) == 0
    assert greedy_accept(torch.tensor([4]), torch.tensor([], dtype=torch.long)) == 0
