"""Accepting drafts: greedy matching, and rejection sampling that keeps the target distribution exactly.

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft token ``d`` drawn from the draft
distribution ``q`` is accepted with probability ``min(1, p(d) / q(d))``; on rejection the token is drawn from
``max(p - q, 0)`` normalised; when every draft is accepted a bonus token is drawn from the last target
distribution. Each emitted token is then distributed exactly as ``p``. A drafter that proposes its argmax has
a one-hot ``q`` (``draft_probs=None``): acceptance with probability ``p(d)``, the residual is ``p`` without ``d``.

These functions take tensors only; the randomness comes in as arguments (uniforms and Exp(1) noise), so the
caller decides where it is drawn (per request, for batch invariance and seeded replay).
"""

from __future__ import annotations

import torch


def greedy_accept(target_ids: torch.Tensor, draft_ids: torch.Tensor) -> int:
    """How many leading drafts equal the target's argmax at their position (``target_ids`` has one more row)."""
    matches = (target_ids[: draft_ids.shape[0]] == draft_ids).int()
    return int(matches.cumprod(0).sum()) if matches.numel() else 0


def _normalised(target_probs, draft_ids, draft_probs):
    p = target_probs.float()
    p = p / p.sum(-1, keepdim=True)
    n, vocab = draft_ids.shape[1], p.shape[-1]
    if draft_probs is None:  # argmax drafts: a one-hot draft distribution
        q = torch.zeros(draft_ids.shape[0], n, vocab, device=p.device).scatter_(-1, draft_ids[..., None], 1.0)
    else:
        q = draft_probs.float() / draft_probs.float().sum(-1, keepdim=True)
    return p, q


def num_accepted(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    uniforms: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Leading drafts accepted [B]: draft j is accepted when ``u_j < p_j(d_j) / q_j(d_j)``.

    ``target_probs`` [B, n + 1, V] (rows need not be normalised), ``draft_ids`` [B, n], ``uniforms`` [B, n] in
    [0, 1), ``draft_probs`` [B, n, V] or None (argmax drafts)."""
    p, q = _normalised(target_probs, draft_ids, draft_probs)
    n = draft_ids.shape[1]
    p_draft = p[:, :n].gather(-1, draft_ids[..., None]).squeeze(-1)
    q_draft = q.gather(-1, draft_ids[..., None]).squeeze(-1)
    accepted = uniforms * q_draft < p_draft  # u < p / q without dividing (q(d) > 0 for a drawn draft)
    return accepted.int().cumprod(-1).sum(-1)


def final_distribution(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    accepted: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the token after the accepted drafts is drawn from [B, V] (unnormalised).

    After a rejection at j: ``max(p_j - q_j, 0)``; when all ``n`` drafts were accepted: the bonus row ``p_n``."""
    p, q = _normalised(target_probs, draft_ids, draft_probs)
    n = draft_ids.shape[1]
    residual = (p[:, :n] - q).clamp_min(0.0)
    # A rejection happens only where p(d) < q(d), so the residual has mass there; guard rounding anyway.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:, :n])
    rows = torch.cat([residual, p[:, n:]], dim=1)  # row j: what to draw when the drafts stop at j
    return rows[torch.arange(rows.shape[0], device=rows.device), accepted]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify ``n`` drafts of ``B`` independent sequences at once.

    Arguments as :func:`num_accepted`, plus ``noise`` [B, V] of Exp(1) draws for the final token (the
    exponential race picks index i with probability row_i / sum(row)). Returns ``(num_accepted [B], last [B])``:
    row b emits its first ``num_accepted[b]`` drafts, then ``last[b]``.
    """
    accepted = num_accepted(target_probs, draft_ids, uniforms, draft_probs)
    row = final_distribution(target_probs, draft_ids, accepted, draft_probs)
    return accepted, (row / noise).argmax(-1)


def accept_argmax_drafts(
    probs: torch.Tensor,
    draft_ids: torch.Tensor,
    num_drafts: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rejection_sample` for argmax drafts (one-hot ``q``) of ``B`` sequences with different draft counts.

    ``probs`` [B, n + 1, V]: each sequence's target probabilities (unnormalised; rows past its ``num_drafts + 1``
    are ignored), ``draft_ids`` [B, n] (ids past a sequence's count are ignored), ``num_drafts`` [B],
    ``uniforms`` [B, n], ``noise`` [B, V] of Exp(1) draws, or [B, n + 1, V]: one row per output position, of
    which the row after the accepted drafts is used (the noise plain decoding draws at that position). Draft j
    is accepted when ``u_j < p_j(d_j)``; after a rejection the token is drawn from ``p_j`` without ``d_j``
    (``max(p - q, 0)``), after all drafts from the bonus row, which is drawn exactly as a plain decode step
    draws it (``probs / noise``, argmax). Returns ``(num_accepted [B], last [B])``, with no host read.
    """
    count, columns = draft_ids.shape
    rows = torch.arange(count, device=probs.device)
    if noise.dim() == 3 and columns == 0:
        noise = noise[:, 0]
    if columns == 0:
        return torch.zeros(count, dtype=torch.long, device=probs.device), (probs[:, 0] / noise).argmax(-1)
    accepted = accepted_argmax_drafts(probs, draft_ids, num_drafts, uniforms)
    if noise.dim() == 3:
        noise = noise[rows, accepted]
    return accepted, (argmax_drafts_final(probs, draft_ids, num_drafts, accepted) / noise).argmax(-1)


def accepted_argmax_drafts(
    probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """:func:`accept_argmax_drafts`' leading accepted drafts [B] (at least one draft column): draft j is accepted
    when ``u_j < p_j(d_j)``."""
    columns = draft_ids.shape[1]
    p_draft = probs[:, :columns].gather(-1, draft_ids[..., None]).squeeze(-1)
    mass = probs[:, :columns].sum(-1)
    valid = torch.arange(columns, device=probs.device)[None, :] < num_drafts[:, None]
    return ((uniforms * mass < p_draft) & valid).long().cumprod(-1).sum(-1)  # u < p(d) / sum(p), undivided


def argmax_drafts_final(
    probs: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor, accepted: torch.Tensor
) -> torch.Tensor:
    """What :func:`accept_argmax_drafts` draws the token after ``accepted`` drafts from [B, V] (unnormalised):
    ``p_j`` without ``d_j`` after a rejection at j, the bonus row after all drafts. Apart from the race, so a
    caller can key the race's noise by the position it lands on once ``accepted`` is known."""
    columns = draft_ids.shape[1]
    row = probs[torch.arange(probs.shape[0], device=probs.device), accepted]
    stopped_at = draft_ids.gather(1, accepted.clamp(max=columns - 1)[:, None])
    residual = row.scatter(-1, stopped_at, 0.0)
    # A rejection happens only where p(d) < 1, so the residual has mass there; guard rounding anyway.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, row)
    return torch.where((accepted < num_drafts)[:, None], residual, row)
