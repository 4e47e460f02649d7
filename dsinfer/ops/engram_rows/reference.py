"""The truth for a decode step's Engram row ids (the hashing rules are described in :mod:`dsinfer.engram.hashing`).

Each sequence has one new token. Its compressed id (``ENGRAM_DEAD`` at image tokens) joins the sequence's
look-back ``history[slot]`` (the last ``N - 1`` compressed ids, oldest first; all dead for a sequence starting at
position 0); read newest first, every id from the first dead one on becomes the pad id; the rolling XOR of
``g_k * multiplier_k`` after ``g_n`` gives the n-gram hash, and each head's row is that hash modulo its prime plus
its layer's offset. The history then drops its oldest id and keeps the token's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.registry import REFERENCE, register

ENGRAM_DEAD = -1  # a compressed id that is no token: before the sequence start, or an image token


def rolling_hash(
    tokens: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Rolling XOR of g_k * m_k; after adding g_{n-1} the running value is the n-gram hash.

    ``tokens`` [..., N] broadcasts against ``multipliers`` [..., N], ``primes`` [..., N - 1, H]
    and ``offsets`` [..., (N - 1) * H].
    """
    products = tokens * multipliers  # int64, below 2**63 by the multiplier bound
    rolling = products[..., 0]
    columns = []
    for n in range(1, products.shape[-1]):
        rolling = torch.bitwise_xor(rolling, products[..., n])
        columns.append(rolling.unsqueeze(-1) % primes[..., n - 1, :])
    return torch.cat(columns, dim=-1) + offsets


@dataclass(frozen=True)
class EngramRowHashing:
    """The hasher's constants a decode step's rows are hashed with: ``vocabulary`` [V] maps token ids to
    compressed ids (``image_token_id``'s to ``ENGRAM_DEAD`` when given), dead ids read as ``pad_id``;
    ``multipliers`` [L, N], ``primes`` [L, N - 1, H], ``offsets`` [L, (N - 1) * H]."""

    vocabulary: torch.Tensor
    image_token_id: int | None
    pad_id: int
    multipliers: torch.Tensor
    primes: torch.Tensor
    offsets: torch.Tensor


@register("engram_decode_rows", REFERENCE)
def engram_decode_rows_reference(
    token_ids: torch.Tensor, history: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, hashing: EngramRowHashing
) -> torch.Tensor:
    """Rows [B, L, (N - 1) * H] of the tokens ``token_ids`` [B] at positions ``starts`` [B] of the sequences in
    ``slots`` [B]; ``history`` [slots, N - 1] (int64) is advanced in place."""
    looked_back = history[slots]
    contexts = torch.where((starts == 0)[:, None], torch.full_like(looked_back, ENGRAM_DEAD), looked_back)
    compressed = hashing.vocabulary[token_ids]
    if hashing.image_token_id is not None:
        compressed = compressed.masked_fill(token_ids == hashing.image_token_id, ENGRAM_DEAD)
    full = torch.cat([contexts, compressed[:, None]], dim=1)  # oldest first; the token last
    looked = full.flip(1)  # column k: the id at t - k
    looked = looked.masked_fill((looked == ENGRAM_DEAD).cumsum(dim=1) > 0, hashing.pad_id)
    rows = rolling_hash(looked.unsqueeze(1), hashing.multipliers, hashing.primes, hashing.offsets)
    history[slots] = full[:, 1:]
    return rows
