"""Prefill attention in Triton: every new token of a packed batch over its window and compressed entries.

One program per (token, head group), varlen over the packed batch through a per-token map to its sequence.
The program loads the query rows of ``BLOCK_H`` heads once and runs an online softmax (running max and sum in
fp32, exp2 with log2(e) folded into the scale) over tiles of ``BLOCK_N`` keys: first the window, the
``window_size`` positions up to its own (a position of this step is read from the new rows ``kv``, an earlier
one from the sequence's ring at ``position % ring_size``, nothing before ``window_from``), then its compressed
entries through the block table: the indexer's choice (CSA, ``indices``; the tiles past the token's last real
index are skipped) or every entry visible at its position (HCA). Every key is one ``D``-wide row that is key and
value at once, so each tile is loaded once and feeds both products of every head of the group (``q @ k^T`` and
``p @ k``, the tile step shared with the decode kernel). The sink joins the normaliser at the end; nothing of
size [H, n, K] is ever stored. The grid and the constexprs depend on shapes only.

Sums run in another order than the reference's and the logits are not rounded to bf16 before the softmax, so
results agree with the reference to rounding (``tests/ops/test_sparse_attention_prefill.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsinfer.ops.registry import register
from dsinfer.ops.sparse_attention.prefill_reference import SparsePrefillInputs, sparse_attention_prefill_reference
from dsinfer.ops.sparse_attention.triton import LOG2E, DecodeConfig, choose_config
from dsinfer.ops.triton_support import tl, triton, triton_available

if triton is not None:
    from dsinfer.ops.sparse_attention.triton import _attend_tile


NO_ENTRIES, CHOSEN_ENTRIES, VISIBLE_ENTRIES = 0, 1, 2  # the kernel's ENTRIES: window only, CSA, HCA


def choose_prefill_config(
    n_heads: int, dtype: torch.dtype, head_dim: int = 512, warpgroup_mma: bool = True
) -> DecodeConfig:
    """The prefill launch by head count, dtype, width and whether the GPU has Hopper's warpgroup MMA
    (``benchmarks/attention_prefill.py --sweep``).

    A prefill program holds one token's heads, so its products are as wide as the head group: with 64 heads of 512
    in bf16 / fp16, all 64 in one program and 64-key tiles at 8 warps and 2 stages (the Hopper MMA's 64 rows; each
    K=V tile read once a token) took 4.76 / 4.89 ms for 8,192 tokens of an HCA / CSA layer at 131,072 context on
    the H100 against 12.63 / 11.00 with 32 heads and 32-key tiles, and 1.49 / 3.49 against 3.20 / 9.07 at 16,384
    (docs/perf.md). These launches spill some registers (~1.7 / 2.7 KiB a thread in sm_90 builds) and still win:
    Triton issues Hopper's warpgroup MMA only for 64-row products. 32 to 63 heads (a rank's share of 64 under
    tensor parallelism): 32-key tiles at 4 warps (6.78 ms for the CSA layer above against 11.00 at 8 warps).
    Narrower heads, fp32 and GPUs before Hopper take the decode kernel's :func:`choose_config`."""
    if warpgroup_mma and dtype != torch.float32 and head_dim >= 256:
        if n_heads >= 64:
            return DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
        if n_heads >= 32:
            return DecodeConfig(block_h=32, block_n=32, num_warps=4, num_stages=2)
    return choose_config(n_heads, dtype, head_dim)


if triton is not None:

    @triton.jit
    def _prefill_kernel(
        q_ptr,
        kv_ptr,
        window_ptr,
        entries_ptr,
        positions_ptr,
        token_seq_ptr,
        sequence_rows_ptr,
        starts_ptr,
        slots_ptr,
        window_from_ptr,
        tables_ptr,
        indices_ptr,
        index_ends_ptr,
        sink_ptr,
        out_ptr,
        n_heads,
        n_indices,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_ws,
        stride_ww,
        stride_eb,
        stride_ep,
        stride_tb,
        stride_it,
        stride_ot,
        stride_oh,
        scale_log2,
        WINDOW: tl.constexpr,
        RING: tl.constexpr,
        WINDOW_TILES: tl.constexpr,
        PER_BLOCK: tl.constexpr,
        RATIO: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ENTRIES: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        token = tl.program_id(0)
        group = tl.program_id(1)
        heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < n_heads
        dims = tl.arange(0, BLOCK_D)
        if BLOCK_D == HEAD_DIM:  # row masks only: the loads stay vectorised along the row
            dim_ok = dims < BLOCK_D
        else:
            dim_ok = dims < HEAD_DIM
        q = tl.load(
            q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
            mask=head_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        # Positions and rows fit int32 (the address arithmetic widens): fewer registers than int64 offsets.
        seq = tl.load(token_seq_ptr + token)
        position = tl.load(positions_ptr + token).to(tl.int32)
        start = tl.load(starts_ptr + seq).to(tl.int32)
        first_row = tl.load(sequence_rows_ptr + seq).to(tl.int32)
        oldest_cached = tl.maximum(tl.load(window_from_ptr + seq).to(tl.int32), 0)
        ring = window_ptr + tl.load(slots_ptr + seq).to(tl.int64) * stride_ws

        running_max = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # finite: exp2 of differences is 0
        running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for tile in range(WINDOW_TILES):
            key = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            key_position = position - WINDOW + 1 + key
            in_window = key < WINDOW
            is_new = in_window & (key_position >= start)
            is_cached = in_window & (key_position < start) & (key_position >= oldest_cached)
            new_row = first_row + key_position - start
            ring_row = key_position % RING
            ring_row = tl.where(ring_row < 0, ring_row + RING, ring_row)
            # One load per tile: each row's address in the new rows or in the ring (the two share a dtype).
            new_rows = kv_ptr + (new_row * stride_kt)[:, None] + dims[None, :]
            ring_rows = ring + (ring_row * stride_ww)[:, None] + dims[None, :]
            visible = is_new | is_cached
            kv = tl.load(
                tl.where(is_new[:, None], new_rows, ring_rows), mask=visible[:, None] & dim_ok[None, :], other=0.0
            )
            running_max, running_sum, acc = _attend_tile(
                q, kv, visible, running_max, running_sum, acc, scale_log2, PRECISION
            )
        if ENTRIES != 0:
            table = tables_ptr + seq * stride_tb
            if ENTRIES == 1:  # the indexer's choice: the tiles up to the token's last real index
                n_tiles = tl.cdiv(tl.load(index_ends_ptr + token), BLOCK_N)
            else:  # every entry whose window has ended at this position
                n_visible = (position + 1) // RATIO
                n_tiles = tl.cdiv(n_visible, BLOCK_N)
            for tile in range(0, n_tiles):
                column = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                if ENTRIES == 1:
                    index = tl.load(
                        indices_ptr + token.to(tl.int64) * stride_it + column, mask=column < n_indices, other=-1
                    )
                    visible = index >= 0
                else:
                    index = column
                    visible = column < n_visible
                block = tl.load(table + index // PER_BLOCK, mask=visible, other=0)
                row = block.to(tl.int64) * stride_eb + (index % PER_BLOCK).to(tl.int64) * stride_ep
                kv = tl.load(
                    entries_ptr + row[:, None] + dims[None, :], mask=visible[:, None] & dim_ok[None, :], other=0.0
                )
                running_max, running_sum, acc = _attend_tile(
                    q, kv, visible, running_max, running_sum, acc, scale_log2, PRECISION
                )

        sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(running_max, sink)
        weight = tl.exp2(running_max - top)
        total = running_sum * weight + tl.exp2(sink - top)
        tl.store(
            out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
            (acc * (weight / total)[:, None]).to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None] & dim_ok[None, :],
        )


def _serves(q, kv, window, entries, indices) -> bool:
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    dim = q.shape[-1]
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or kv.shape[-1] != dim:
        return False
    if kv.shape[0] * kv.stride(0) >= 2**31 or window.shape[1] * window.stride(1) >= 2**31:  # int32 row offsets
        return False
    if window.stride(-1) != 1 or window.shape[-1] != dim or window.dtype != kv.dtype:
        return False
    if entries is not None and (entries.stride(-1) != 1 or entries.shape[-1] != dim):
        return False
    return indices is None or indices.dim() == 2


class EntryOperands(NamedTuple):
    """What the prefill kernel reads of the compressed entries (placeholders where it reads none)."""

    mode: int
    entries: torch.Tensor
    tables: torch.Tensor
    indices: torch.Tensor
    index_ends: torch.Tensor
    n_indices: int
    per_block: int
    strides: tuple[int, int]


def entry_operands(inputs: SparsePrefillInputs, token_seq: torch.Tensor) -> EntryOperands:
    """The entry operands of the launch: CSA's chosen indices (and the last real one of each token, so tiles past
    it are skipped), HCA's every visible entry, or none (window only: the entry pointers are never read)."""
    entries, indices = inputs.entries, inputs.indices
    mode = NO_ENTRIES if entries is None else (VISIBLE_ENTRIES if indices is None else CHOSEN_ENTRIES)
    if mode == CHOSEN_ENTRIES and indices.shape[1] == 0:
        mode = NO_ENTRIES
    if mode == NO_ENTRIES:
        return EntryOperands(mode, inputs.kv, token_seq, token_seq, token_seq, 0, 1, (0, 0))
    n_indices, index_ends = 0, token_seq
    if mode == CHOSEN_ENTRIES:
        indices = indices.contiguous()
        n_indices = indices.shape[1]
        columns = torch.arange(1, n_indices + 1, device=indices.device)
        index_ends = torch.where(indices >= 0, columns, 0).amax(dim=1)
    else:
        indices = token_seq
    strides = (entries.stride(0), entries.stride(1))
    return EntryOperands(mode, entries, inputs.block_tables.contiguous(), indices, index_ends, n_indices,
                         entries.shape[1], strides)  # fmt: skip


def sparse_attention_prefill_launch(inputs: SparsePrefillInputs, config: DecodeConfig | None = None) -> torch.Tensor:
    """The kernel, no fallback; ``config`` (default: :func:`choose_prefill_config`) fixes the launch.

    ``inputs.spans`` (the reference's host-known bounds) is not read: the kernel reads the tensors."""
    q, kv, window = inputs.q, inputs.kv, inputs.window
    tokens, n_heads, head_dim = q.shape
    if config is None:  # Triton's interpreter (a CPU tensor) runs the Hopper launch too
        older_gpu = q.is_cuda and torch.cuda.get_device_capability(q.device)[0] < 9
        config = choose_prefill_config(n_heads, q.dtype, head_dim, warpgroup_mma=not older_gpu)
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs 16 along every axis
    token_ids = torch.arange(tokens, device=q.device)
    token_seq = torch.searchsorted(inputs.sequence_rows[1:].contiguous(), token_ids, right=True)
    entries = entry_operands(inputs, token_seq)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _prefill_kernel[(tokens, triton.cdiv(n_heads, config.block_h))](
        q, kv, window, entries.entries, inputs.positions.contiguous(), token_seq, inputs.sequence_rows.contiguous(),
        inputs.starts.contiguous(), inputs.slots.contiguous(), inputs.window_from.contiguous(), entries.tables,
        entries.indices, entries.index_ends, inputs.sink.contiguous(), out, n_heads, entries.n_indices, q.stride(0),
        q.stride(1), kv.stride(0), window.stride(0), window.stride(1), *entries.strides, entries.tables.stride(0),
        entries.indices.stride(0), out.stride(0), out.stride(1), inputs.softmax_scale * LOG2E,
        WINDOW=inputs.window_size, RING=window.shape[1], WINDOW_TILES=triton.cdiv(inputs.window_size, config.block_n),
        PER_BLOCK=entries.per_block, RATIO=max(1, inputs.compress_ratio), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=config.block_h, BLOCK_N=config.block_n, ENTRIES=entries.mode, PRECISION=precision,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


@register(
    "sparse_attention_prefill",
    "triton",
    devices=("cuda",),
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    available=triton_available,
    priority=10,
)
def sparse_attention_prefill_triton(inputs: SparsePrefillInputs) -> torch.Tensor:
    """Same contract as the reference; inputs the kernel does not serve go to the reference (a kernel that fails
    to compile here falls back through the registry, :func:`dsinfer.ops.registry.falls_back_to_reference`)."""
    if not _serves(inputs.q, inputs.kv, inputs.window, inputs.entries, inputs.indices):
        return sparse_attention_prefill_reference(inputs)
    return sparse_attention_prefill_launch(inputs)
