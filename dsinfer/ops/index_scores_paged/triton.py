"""A decode step's index scores in Triton, read through the block tables from the paged keys (plain or FP4).

The torch path gathered every block-table slot's index keys into a new [B, W, d] tensor each step (and, with
coded storage, decoded it: more kernels and a second copy) before scoring. Here one program per (sequence, tile
of ``BLOCK_E`` slots) loads its keys where they are stored, decodes packed e2m1 codes times their ue8m0 scale
when the pool is coded (exact), and forms the [heads, BLOCK_E] products with one ``tl.dot`` against the query
(16-bit operands on the tensor cores, products exact in float32; float32 queries in IEEE float32), then ReLU, the
1 / sqrt(d) scale, the head weights and the sum over heads. A tile past the visible entries writes -inf without
reading a key. Sums run in another order than torch's: scores agree to float32 rounding, and exact zeros (every
head's ReLU at 0) stay exact (``tests/ops/test_index_scores_paged.py``).
"""

from __future__ import annotations

import torch

from dsinfer.ops.index_scores_paged.reference import index_scores_paged_reference
from dsinfer.ops.registry import register
from dsinfer.ops.sparse_attention.triton import sparse_attention_triton_available

try:
    import triton
    import triton.language as tl

    from dsinfer.ops.cache_codec.triton import ue8m0_value
    from dsinfer.ops.fake_quant.triton import e2m1_magnitude
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

BLOCK_E = 32  # slots per program
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if triton is not None:

    @triton.jit
    def _paged_scores_kernel(q_ptr, weights_ptr, keys_ptr, scales_ptr, tables_ptr, visible_ptr, scores_ptr,
                             n_heads, width, stride_qb, stride_qh, stride_wb, stride_kb, stride_kp, stride_sb_,
                             stride_sp, stride_tb, stride_ob, scale, PER_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                             SCALE_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
                             CODED: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
        seq = tl.program_id(0).to(tl.int64)
        slot = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        count = tl.load(visible_ptr + seq)
        seen = (slot < count) & (slot < width)
        out = scores_ptr + seq * stride_ob + slot
        if tl.program_id(1) * BLOCK_E < count:
            heads = tl.arange(0, BLOCK_H)
            head_ok = heads < n_heads
            dims = tl.arange(0, HEAD_DIM)
            q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None],
                        other=0.0)  # fmt: skip
            block = tl.load(tables_ptr + seq * stride_tb + slot // PER_BLOCK, mask=seen, other=0).to(tl.int64)
            in_block = (slot % PER_BLOCK).to(tl.int64)
            if CODED:
                pairs = tl.arange(0, HEAD_DIM // 2)
                packed = tl.load(keys_ptr + (block * stride_kb + in_block * stride_kp)[:, None] + pairs[None, :],
                                 mask=seen[:, None], other=0).to(tl.int32)  # fmt: skip
                code = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BLOCK_E, HEAD_DIM])
                magnitude = e2m1_magnitude(code & 0x7)
                exponent = tl.load(scales_ptr + (block * stride_sb_ + in_block * stride_sp)[:, None]
                                   + (dims // SCALE_BLOCK)[None, :], mask=seen[:, None], other=127)  # fmt: skip
                keys = tl.where((code & 0x8) != 0, -magnitude, magnitude) * ue8m0_value(exponent.to(tl.int32))
            else:
                keys = tl.load(keys_ptr + (block * stride_kb + in_block * stride_kp)[:, None] + dims[None, :],
                               mask=seen[:, None], other=0.0)  # fmt: skip
            if PRECISION == "ieee":
                products = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
            else:
                products = tl.dot(q, tl.trans(keys.to(q.dtype)))
            weights = tl.load(weights_ptr + seq * stride_wb + heads, mask=head_ok, other=0.0)
            scores = tl.sum(tl.maximum(products, 0.0) * weights[:, None], axis=0) * scale
            tl.store(out, tl.where(seen, scores, float("-inf")), mask=slot < width)
        else:
            tl.store(out, tl.full([BLOCK_E], float("-inf"), dtype=tl.float32), mask=slot < width)


def serves(q, keys, key_scales) -> bool:
    """Whether the kernel takes these inputs (else the reference runs)."""
    if q.dim() != 3 or q.dtype not in DTYPES or q.stride(-1) != 1 or keys.stride(-1) != 1:
        return False
    head_dim = q.shape[-1]
    if head_dim < 16 or head_dim & (head_dim - 1):
        return False
    if key_scales is None:
        return keys.shape[-1] == head_dim and keys.dtype == q.dtype
    return keys.shape[-1] * 2 == head_dim and key_scales.stride(-1) == 1 and head_dim % key_scales.shape[-1] == 0


@register("index_scores_paged", "triton", devices=("cuda",), available=sparse_attention_triton_available,
          priority=10)  # fmt: skip
def index_scores_paged_triton(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    key_scales: torch.Tensor | None,
    block_tables: torch.Tensor,
    visible: torch.Tensor,
) -> torch.Tensor:
    """Same contract as the reference; inputs the kernel does not take go to it."""
    if not serves(q, keys, key_scales):
        return index_scores_paged_reference(q, head_weights, keys, key_scales, block_tables, visible)
    batch, n_heads, head_dim = q.shape
    per_block = keys.shape[1]
    width = block_tables.shape[1] * per_block
    scores = torch.empty(batch, width, dtype=torch.float32, device=q.device)
    if batch == 0 or width == 0:
        return scores
    coded = key_scales is not None
    keys_arg = keys.view(torch.uint8) if coded else keys
    scales_arg = key_scales.view(torch.uint8) if coded else keys_arg
    weights, tables, visible = head_weights.float().contiguous(), block_tables.contiguous(), visible.contiguous()
    _paged_scores_kernel[(batch, triton.cdiv(width, BLOCK_E))](
        q, weights, keys_arg, scales_arg, tables, visible, scores, n_heads, width, q.stride(0), q.stride(1),
        weights.stride(0), keys_arg.stride(0), keys_arg.stride(1), scales_arg.stride(0) if coded else 0,
        scales_arg.stride(1) if coded else 0, tables.stride(0), scores.stride(0), head_dim**-0.5,
        PER_BLOCK=per_block, HEAD_DIM=head_dim, SCALE_BLOCK=head_dim // key_scales.shape[-1] if coded else 1,
        BLOCK_H=max(16, triton.next_power_of_2(n_heads)), BLOCK_E=BLOCK_E, CODED=coded,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4,
    )  # fmt: skip
    return scores
