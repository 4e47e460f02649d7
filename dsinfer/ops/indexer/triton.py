"""The lightning indexer's decode step in two launches: the scores in one Triton kernel, the top-k in another.

The reference gathers every entry slot of every block table into a [B, W, d] tensor, then forms the per-head
products [B, nh, W] in memory before weighting and summing them. Here one program per (sequence, tile of
``BLOCK_E`` slots) reads its keys through the block table, computes the [nh, BLOCK_E] products with one
``tl.dot`` against the sequence's queries (kept in fp32, IEEE, as the reference computes them), applies ReLU,
the 1 / sqrt(d) scale and the head weights, and writes only the summed scores, -inf past the visible entries.
A tile with no visible slot writes -inf without reading a key. The sums over d and heads run in another order
than torch's, so scores agree to fp32 rounding (``tests/ops/test_indexer.py``).

The choice is ``index_topk_decode``'s one-program-per-row selection (the reference's packed-key top-k, gather and
sort took about fifteen launches, among them an int64 ``topk`` and a radix sort): the same entries in the same
order, the lowest entry on ties. Where a slot is not real its entry number is -1 here (the reference leaves some
unseen slot's number there); the attention reads only the real ones.
"""

from __future__ import annotations

import logging
import os

import torch

from dsinfer.ops.index_select.triton import index_topk_decode_triton
from dsinfer.ops.indexer.reference import indexer_topk_decode_reference
from dsinfer.ops.registry import register

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

logger = logging.getLogger(__name__)

# Entry slots per program and warps: at 64 heads x 128 for sm_90 the only pair without register spills on both
# triton 3.6 and 3.9 (BLOCK_E 32 with 8 warps spills 208 bytes a thread on 3.6; 4 warps spill on either).
BLOCK_E = 16
NUM_WARPS = 8


def indexer_triton_available() -> bool:
    return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

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


def indexer_scores_launch(
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


_COMPILED: set[tuple] = set()
_FAILED: set[tuple] = set()


def choose_visible(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's ``select_visible_topk`` on scores that are -inf past each row's visible entries: the chosen
    entries [B, min(k, W)] in position order (-1 where not real) and which are real."""
    chosen = index_topk_decode_triton(scores, k)
    return chosen, chosen >= 0


@register(
    "indexer_topk_decode",
    "triton",
    devices=("cuda",),
    available=indexer_triton_available,
    priority=10,
)
def indexer_topk_decode_triton(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    block_tables: torch.Tensor,
    visible: torch.Tensor,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the reference; a kernel that fails to compile here (warned once) leaves it the work."""
    args = (q, head_weights, keys, block_tables, visible, k)
    if q.dim() != 3 or keys.stride(-1) != 1 or keys.shape[-1] != q.shape[-1]:
        return indexer_topk_decode_reference(*args)
    setting = (q.device, q.shape[1:], keys.dtype, keys.shape[1:], block_tables.shape)
    if setting in _FAILED:
        return indexer_topk_decode_reference(*args)
    if setting in _COMPILED:
        return choose_visible(indexer_scores_launch(q, head_weights, keys, block_tables, visible), k)
    try:
        scores = indexer_scores_launch(q, head_weights, keys, block_tables, visible)
    except Exception as error:  # a compile failure (Triton version, resources): degrade, never crash
        if q.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise
        logger.warning("indexer_topk_decode: Triton kernel failed (%s); using the torch reference", error)
        _FAILED.add(setting)
        return indexer_topk_decode_reference(*args)
    _COMPILED.add(setting)
    return choose_visible(scores, k)
