"""The indexer's previous decode kernel, kept for the same-run comparison of ``indexer_decode.py``: one program per
(sequence, 16 slots), the whole float32 query reloaded by each, IEEE float32 products; then the top-k as it ran
(the one-program selection up to 16,384 slots a row, the torch reference past that)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsinfer.ops.index_select.reference import index_topk_decode_reference
from dsinfer.ops.index_select.triton import index_topk_decode_triton

BLOCK_E = 16
NUM_WARPS = 8
PREVIOUS_MAX_WIDTH = 16384


@triton.jit
def _indexer_scores_kernel(
    q_ptr,
    weights_ptr,
    keys_ptr,
    tables_ptr,
    visible_ptr,
    scores_ptr,
    n_heads,
    width,
    stride_qb,
    stride_qh,
    stride_wb,
    stride_kb,
    stride_kp,
    stride_tb,
    stride_sb,
    scale,
    PER_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_NH: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    seq = tl.program_id(0)
    slot = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    count = tl.load(visible_ptr + seq)
    seen = (slot < count) & (slot < width)
    out = scores_ptr + seq * stride_sb + slot
    if tl.program_id(1) * BLOCK_E < count:
        heads = tl.arange(0, BLOCK_NH)
        head_ok = heads < n_heads
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=head_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        block = tl.load(tables_ptr + seq * stride_tb + slot // PER_BLOCK, mask=seen, other=0)
        rows = block.to(tl.int64) * stride_kb + (slot % PER_BLOCK).to(tl.int64) * stride_kp
        keys = tl.load(keys_ptr + rows[:, None] + dims[None, :], mask=seen[:, None] & dim_ok[None, :], other=0.0)
        products = tl.dot(q, tl.trans(keys.to(tl.float32)), input_precision="ieee")  # [nh, BLOCK_E]
        per_head = tl.maximum(products, 0.0) * scale
        weights = tl.load(weights_ptr + seq * stride_wb + heads, mask=head_ok, other=0.0)
        scores = tl.sum(per_head * weights[:, None], axis=0)
        tl.store(out, tl.where(seen, scores, float("-inf")), mask=slot < width)
    else:
        tl.store(out, tl.full([BLOCK_E], float("-inf"), dtype=tl.float32), mask=slot < width)


def previous_scores_launch(
    q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, block_tables: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """Scores [B, max_blocks * per_block] float32, -inf past each sequence's ``visible`` entries (no fallback)."""
    batch, n_heads, head_dim = q.shape
    per_block = keys.shape[1]
    width = block_tables.shape[1] * per_block
    scores = torch.empty(batch, width, dtype=torch.float32, device=q.device)
    if batch == 0 or width == 0:
        return scores
    q, head_weights = q.float().contiguous(), head_weights.float().contiguous()
    tables, visible = block_tables.contiguous(), visible.contiguous()
    _indexer_scores_kernel[(batch, triton.cdiv(width, BLOCK_E))](
        q,
        head_weights,
        keys,
        tables,
        visible,
        scores,
        n_heads,
        width,
        q.stride(0),
        q.stride(1),
        head_weights.stride(0),
        keys.stride(0),
        keys.stride(1),
        tables.stride(0),
        scores.stride(0),
        head_dim**-0.5,
        PER_BLOCK=per_block,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_NH=max(16, triton.next_power_of_2(n_heads)),
        BLOCK_E=BLOCK_E,
        num_warps=NUM_WARPS,
    )
    return scores


def previous_indexer_topk_decode(q, head_weights, keys, block_tables, visible, k):
    """The previous op: its scores kernel on a float32 query, then the selection it used."""
    scores = previous_scores_launch(q.float(), head_weights, keys, block_tables, visible)
    select = index_topk_decode_triton if scores.shape[1] <= PREVIOUS_MAX_WIDTH else index_topk_decode_reference
    chosen = select(scores, k)
    return chosen, chosen >= 0
