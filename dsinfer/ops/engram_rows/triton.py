"""A decode step's Engram row ids in one Triton kernel: one program per sequence.

The torch path runs about twenty-five small integer kernels (the history gather, the fresh-sequence mask, the
vocabulary lookup, a cat, a flip, a cumulative dead mask, per n-gram a multiply, an XOR and a modulo, a cat, the
offsets, the history scatter). Here a program reads its token and look-back, forms the newest-first ids with the
dead-to-pad rule (a running count), the rolling XOR as a prefix scan, and writes every layer's row ids and the
advanced history. Integer arithmetic only: the same ids as the reference (``tests/ops/test_engram_rows.py``).
"""

from __future__ import annotations

import torch

from dsinfer.ops.engram_rows.reference import EngramRowHashing, engram_decode_rows_reference
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

if triton is not None:

    @triton.jit
    def _xor(a, b):
        return a ^ b

    @triton.jit
    def _decode_rows_kernel(tokens_ptr, history_ptr, slots_ptr, starts_ptr, vocabulary_ptr, multipliers_ptr,
                            primes_ptr, offsets_ptr, rows_ptr, n_layers, stride_h, image_token_id, pad_id,
                            N: tl.constexpr, HEADS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                            HAS_IMAGE: tl.constexpr):  # fmt: skip
        seq = tl.program_id(0).to(tl.int64)
        token = tl.load(tokens_ptr + seq)
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        fresh = tl.load(starts_ptr + seq) == 0
        compressed = tl.load(vocabulary_ptr + token).to(tl.int64)
        if HAS_IMAGE:
            compressed = tl.where(token == image_token_id, -1, compressed)
        row = history_ptr + slot * stride_h
        k = tl.arange(0, BLOCK_N)
        # Newest first: column k is the id at t - k (the token, then the look-back from its newest end).
        past = tl.load(row + (N - 1 - k), mask=(k >= 1) & (k < N), other=-1).to(tl.int64)
        looked = tl.where(k == 0, compressed, tl.where(fresh, -1, past))
        shifted = tl.load(row + k + 1, mask=k + 1 < N - 1, other=-1).to(tl.int64)
        advanced = tl.where(k == N - 2, compressed, tl.where(fresh, -1, shifted))
        tl.debug_barrier()  # every read of the history row before it is overwritten
        tl.store(row + k, advanced, mask=k < N - 1)
        dead = tl.cumsum(((looked == -1) & (k < N)).to(tl.int32), axis=0) > 0
        looked = tl.where(dead, pad_id, looked)
        heads = tl.arange(0, BLOCK_H)
        head_ok = heads < HEADS
        for layer in range(n_layers):
            multipliers = tl.load(multipliers_ptr + layer * N + k, mask=k < N, other=0)
            rolling = tl.associative_scan(looked * multipliers, 0, _xor)  # rolling[n]: the (n + 1)-gram's hash
            for n in tl.static_range(1, N):
                hashed = tl.sum(tl.where(k == n, rolling, 0), axis=0)
                column = layer * (N - 1) * HEADS + (n - 1) * HEADS + heads
                prime = tl.load(primes_ptr + column, mask=head_ok, other=1)
                offset = tl.load(offsets_ptr + column, mask=head_ok, other=0)
                tl.store(rows_ptr + seq * n_layers * (N - 1) * HEADS + column, hashed % prime + offset, mask=head_ok)


@register("engram_decode_rows", "triton", devices=("cuda",), available=triton_available,
          priority=10)  # fmt: skip
def engram_decode_rows_triton(
    token_ids: torch.Tensor, history: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, hashing: EngramRowHashing
) -> torch.Tensor:
    """Same contract and ids as the reference; a history that is not int64 rows goes to it."""
    multipliers, image_token_id = hashing.multipliers, hashing.image_token_id
    n_layers, n, heads = multipliers.shape[0], multipliers.shape[1], hashing.primes.shape[-1]
    if history.dtype != torch.int64 or history.stride(-1) != 1 or n < 2 or history.shape[-1] != n - 1:
        return engram_decode_rows_reference(token_ids, history, slots, starts, hashing)
    batch = token_ids.shape[0]
    rows = torch.empty(batch, n_layers, (n - 1) * heads, dtype=torch.int64, device=token_ids.device)
    if batch == 0:
        return rows
    _decode_rows_kernel[(batch,)](
        token_ids.contiguous(), history, slots.contiguous(), starts.contiguous(), hashing.vocabulary.contiguous(),
        multipliers.contiguous(), hashing.primes.contiguous(), hashing.offsets.contiguous(), rows, n_layers,
        history.stride(0), -1 if image_token_id is None else image_token_id, hashing.pad_id, N=n, HEADS=heads,
        BLOCK_N=triton.next_power_of_2(n), BLOCK_H=triton.next_power_of_2(heads), HAS_IMAGE=image_token_id is not None,
        num_warps=1,
    )  # fmt: skip
    return rows
