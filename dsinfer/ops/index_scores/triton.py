"""The lightning indexer's scores in Triton: one [n, W] fp32 write, never the [n, H, W] per-head products.

The reference forms every head's product ``q[t, h] . k[w]`` in memory ([n, H, W] fp32: 17 GB for a 16,384-token
V4-Flash prompt) before the ReLU, the weights and the sum over heads. Here each program owns a tile of scores
and keeps its fp32 sum in registers while it runs over the heads:

* shared keys [W, d] (V4 and V4.1 prefill): a program takes ``BLOCK_T`` queries x ``BLOCK_W`` entries, loads
  the entries' keys once and, head by head, forms the [BLOCK_T, BLOCK_W] products with one ``tl.dot`` (the
  query tile is the product's M), then adds ``weight[t, h] * ReLU(product)``. Query tiles run along the slow
  grid axis so the programs sharing a query tile run together and read it from L2.
* per-query keys [n, W, d] (V4.1 decode reads each sequence's entries): there is no key tile to share between
  queries, so a program takes one query x ``BLOCK_W`` entries and runs over the heads in chunks of ``BLOCK_H``
  (the chunk is the product's M), summing each chunk's weighted ReLU products over its heads.

On sm_90 shared 16-bit keys of 128 channels take the Gluon kernel instead (:mod:`.hopper`: the next head's MMA
runs beside this head's sums), unless a launch names a Triton one.

Both scale by 1 / sqrt(d) once at the end, write -inf at the entries a query may not see (``w >= visible[t]``),
and skip every key load of a tile with no visible entry (half the tiles of a causal prefill). bf16 / fp16
queries with keys of the same dtype take the tensor cores (products exact in fp32, fp32 accumulation); any fp32
input computes the products in IEEE fp32, as the reference does. Sums run in another order than torch's, so
scores agree to fp32 rounding; exact zeros (every head's ReLU at 0) stay exact, so the top-k's ties fall the
same way (``tests/ops/test_index_scores_triton.py``). ``index_topk`` is these scores and the reference's
:func:`top_k_in_order` (lowest index first among ties).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.index_scores.hopper import hopper_shared_keys_fits, hopper_shared_keys_launch
from dsinfer.ops.index_scores.reference import index_scores_reference, index_topk_reference, top_k_in_order
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

SERVED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis


@dataclass(frozen=True)
class ScoresConfig:
    block_t: int  # shared keys: queries per program (the dot's M); per-query keys: 1
    block_w: int  # entries per program (the dot's N)
    block_h: int  # per-query keys: heads per chunk (the dot's M); shared keys: unused (one head a step)
    block_k: int  # fp32: the slice of d one IEEE dot takes (16-bit: the whole head, one dot)
    num_warps: int
    num_stages: int
    max_registers: int = 0  # the compiler's cap a thread (``maxnreg``); 0: its own choice
    kernel: str = "triton"  # shared 16-bit keys on sm_90: "gluon" runs :mod:`.hopper` (64 x block_w of 128 or 256)


def choose_config(shared_keys: bool, tensor_cores: bool, n_heads: int) -> ScoresConfig:
    """The launch by key layout and arithmetic (``benchmarks/indexer_prefill.py --sweep`` times others).

    Shared keys, 16-bit: 64 queries x 128 entries at 8 warps, 3 stages: the key tile and the pipelined query
    tiles in shared memory, ~160 registers a thread; each query tile read feeds 128 entries' products. fp32
    (IEEE products on CUDA cores, whose operands a thread holds whole): 32 x 64 in slices of 16 of d at
    8 warps; slices of 32, or 4 warps, spill. Per-query keys: 32 entries a program, up to 64 heads a chunk,
    8 warps. At 64 heads x 128 the sm_90 builds of all of these hold no spills (the build check in
    ``tests/ops/test_index_scores_triton.py``).
    """
    if shared_keys:
        if tensor_cores:
            return ScoresConfig(block_t=64, block_w=128, block_h=0, block_k=0, num_warps=8, num_stages=3)
        return ScoresConfig(block_t=32, block_w=64, block_h=0, block_k=16, num_warps=8, num_stages=2)
    block_h = min(64, max(16, triton.next_power_of_2(n_heads)))
    return ScoresConfig(block_t=1, block_w=32, block_h=block_h, block_k=0 if tensor_cores else 16,
                        num_warps=8, num_stages=2)  # fmt: skip


if triton is not None:

    @triton.jit
    def _products(q_rows, q_mask, key_rows, key_mask, dims, keys, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                  HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
        """One head's (or head chunk's) dot products [rows of q, entries]: 16-bit against the resident ``keys``
        in one ``tl.dot``; fp32 (IEEE, on CUDA cores) in ``BLOCK_K``-wide slices of d, the key slices re-read
        from cache each time (whole 128-wide fp32 operands would spill)."""
        if BLOCK_K == BLOCK_D:
            q = tl.load(q_rows + dims[None, :], mask=q_mask[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
            if PRECISION == "ieee":  # a narrow fp32 head: whole, cast once per operand
                products = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
            else:
                products = tl.dot(q, tl.trans(keys), input_precision=PRECISION)
        else:
            products = tl.zeros([q_rows.shape[0], key_rows.shape[0]], dtype=tl.float32)
            for first_dim in tl.static_range(0, BLOCK_D, BLOCK_K):
                part = first_dim + tl.arange(0, BLOCK_K)
                part_ok = part < HEAD_DIM
                q = tl.load(q_rows + part[None, :], mask=q_mask[:, None] & part_ok[None, :], other=0.0)
                k = tl.load(key_rows + part[None, :], mask=key_mask[:, None] & part_ok[None, :], other=0.0)
                products = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), products, input_precision="ieee")
        return products

    @triton.jit
    def _shared_keys_kernel(
        q_ptr,
        keys_ptr,
        weights_ptr,
        visible_ptr,
        scores_ptr,
        n_queries,
        n_heads,
        width,
        stride_qt,
        stride_qh,
        stride_kw,
        stride_wt,
        stride_wh,
        stride_st,
        scale,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_W: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        first_entry = tl.program_id(0) * BLOCK_W
        entry = first_entry + tl.arange(0, BLOCK_W)
        query = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        query_ok = query < n_queries
        count = tl.load(visible_ptr + query, mask=query_ok, other=0)
        out = scores_ptr + query.to(tl.int64)[:, None] * stride_st + entry[None, :]
        in_bounds = query_ok[:, None] & (entry < width)[None, :]
        most = tl.max(count, axis=0)  # the tile's widest view: entries past it are never read
        if first_entry < most:
            dims = tl.arange(0, BLOCK_D)
            entry_ok = (entry < width) & (entry < most)
            key_rows = keys_ptr + entry.to(tl.int64)[:, None] * stride_kw
            keys = None
            if BLOCK_K == BLOCK_D:  # the tile's keys load once and serve every head
                keys = tl.load(key_rows + dims[None, :], mask=entry_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
            q_rows = q_ptr + query.to(tl.int64)[:, None] * stride_qt
            weight_rows = weights_ptr + query.to(tl.int64) * stride_wt
            acc = tl.zeros([BLOCK_T, BLOCK_W], dtype=tl.float32)
            for head in range(0, n_heads):
                products = _products(q_rows + head * stride_qh, query_ok, key_rows, entry_ok, dims, keys,
                                     BLOCK_D, BLOCK_K, HEAD_DIM, PRECISION)  # fmt: skip
                weight = tl.load(weight_rows + head * stride_wh, mask=query_ok, other=0.0).to(tl.float32)
                acc += tl.maximum(products, 0.0) * weight[:, None]
            seen = entry[None, :] < count[:, None]
            tl.store(out, tl.where(seen, acc * scale, float("-inf")), mask=in_bounds)
        else:
            tl.store(out, tl.full([BLOCK_T, BLOCK_W], float("-inf"), dtype=tl.float32), mask=in_bounds)

    @triton.jit
    def _per_query_keys_kernel(
        q_ptr,
        keys_ptr,
        weights_ptr,
        visible_ptr,
        scores_ptr,
        n_heads,
        width,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kw,
        stride_wt,
        stride_wh,
        stride_st,
        scale,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_W: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        first_entry = tl.program_id(0) * BLOCK_W
        entry = first_entry + tl.arange(0, BLOCK_W)
        query = tl.program_id(1).to(tl.int64)
        count = tl.load(visible_ptr + query)
        seen = (entry < count) & (entry < width)
        out = scores_ptr + query * stride_st + entry
        if first_entry < count:
            dims = tl.arange(0, BLOCK_D)
            key_rows = keys_ptr + query * stride_kt + entry.to(tl.int64)[:, None] * stride_kw
            keys = None
            if BLOCK_K == BLOCK_D:
                keys = tl.load(key_rows + dims[None, :], mask=seen[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
            acc = tl.zeros([BLOCK_W], dtype=tl.float32)
            for first_head in range(0, n_heads, BLOCK_H):
                heads = first_head + tl.arange(0, BLOCK_H)
                head_ok = heads < n_heads
                q_rows = q_ptr + query * stride_qt + heads[:, None] * stride_qh
                products = _products(q_rows, head_ok, key_rows, seen, dims, keys,
                                     BLOCK_D, BLOCK_K, HEAD_DIM, PRECISION)  # fmt: skip
                weight = tl.load(weights_ptr + query * stride_wt + heads * stride_wh, mask=head_ok, other=0.0)
                acc += tl.sum(tl.maximum(products, 0.0) * weight.to(tl.float32)[:, None], axis=0)
            tl.store(out, tl.where(seen, acc * scale, float("-inf")), mask=entry < width)
        else:
            tl.store(out, tl.full([BLOCK_W], float("-inf"), dtype=tl.float32), mask=entry < width)


def serves(q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, visible: torch.Tensor) -> bool:
    """Whether the kernels take these inputs (anything else, the reference runs)."""
    if q.dim() != 3 or keys.dim() not in (2, 3) or head_weights.shape != q.shape[:2] or visible.shape != q.shape[:1]:
        return False
    if keys.dim() == 3 and (keys.shape[0] != q.shape[0] or q.shape[0] > MAX_GRID_Y):  # one query a grid row
        return False
    if q.dtype not in SERVED_DTYPES or keys.dtype not in SERVED_DTYPES or head_weights.dtype not in SERVED_DTYPES:
        return False
    if visible.dtype not in (torch.int32, torch.int64):
        return False
    return keys.shape[-1] == q.shape[-1] and q.stride(-1) == 1 and keys.stride(-1) == 1


def uses_tensor_cores(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """16-bit queries and keys of one dtype: exact products, fp32 sums. Any fp32 input: IEEE fp32 products."""
    return q.dtype == keys.dtype and q.dtype in (torch.bfloat16, torch.float16)


def index_scores_launch(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_weights: torch.Tensor,
    visible: torch.Tensor,
    config: ScoresConfig | None = None,
) -> torch.Tensor:
    """The kernels, no fallback: scores [n, W] float32 (inputs as the reference takes them, :func:`serves`).
    Without a ``config``, shared keys the Gluon kernel takes (:func:`hopper_shared_keys_fits`) run on it (1.10x the
    Triton kernel at 8,192 queries x 32,768 entries on an H100, docs/perf.md); the rest on :func:`choose_config`'s
    Triton launch."""
    n_queries, n_heads, head_dim = q.shape
    width = keys.shape[-2]
    scores = torch.empty(n_queries, width, dtype=torch.float32, device=q.device)
    if n_queries == 0 or width == 0:
        return scores
    shared = keys.dim() == 2
    if shared and (config is None or config.kernel == "gluon") and hopper_shared_keys_fits(q, keys):
        launch = {} if config is None else dict(num_stages=config.num_stages, warpgroups=config.block_w // 128)
        hopper_shared_keys_launch(q, keys, head_weights, visible.contiguous(), scores, **launch)
        return scores
    tensor_cores = uses_tensor_cores(q, keys)
    config = config or choose_config(shared, tensor_cores, n_heads)
    precision = "tf32" if tensor_cores else "ieee"  # 16-bit dots ignore it; fp32 ones take IEEE
    visible = visible.contiguous()
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs 16 along every axis
    block_k = block_d if tensor_cores or config.block_k >= block_d else max(16, config.block_k)
    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_K=block_k, BLOCK_W=config.block_w, PRECISION=precision)
    launch = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    if config.max_registers:
        launch["maxnreg"] = config.max_registers
    if shared:
        grid = (triton.cdiv(width, config.block_w), triton.cdiv(n_queries, config.block_t))
        _shared_keys_kernel[grid](
            q, keys, head_weights, visible, scores,
            n_queries, n_heads, width,
            q.stride(0), q.stride(1), keys.stride(0), head_weights.stride(0), head_weights.stride(1), scores.stride(0),
            head_dim**-0.5,
            BLOCK_T=config.block_t, **common, **launch,
        )  # fmt: skip
    else:
        grid = (triton.cdiv(width, config.block_w), n_queries)
        _per_query_keys_kernel[grid](
            q, keys, head_weights, visible, scores,
            n_heads, width,
            q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), head_weights.stride(0), head_weights.stride(1),
            scores.stride(0),
            head_dim**-0.5,
            BLOCK_H=config.block_h, **common, **launch,
        )  # fmt: skip
    return scores


@register(
    "index_scores",
    "triton",
    devices=("cuda",),
    dtypes=SERVED_DTYPES,
    available=triton_available,
    priority=10,
)
def index_scores_triton(
    q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """Same contract as the reference; inputs the kernels do not take go to the reference (a kernel that fails to
    compile here is the registry's to fall back from)."""
    args = (q, keys, head_weights, visible)
    if not serves(*args):
        return index_scores_reference(*args)
    return index_scores_launch(*args)


@register(
    "index_topk",
    "triton",
    devices=("cuda",),
    dtypes=SERVED_DTYPES,
    available=triton_available,
    priority=10,
)
def index_topk_triton(
    q: torch.Tensor, keys: torch.Tensor, head_weights: torch.Tensor, visible: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's choice from the kernels' scores: no [n, H, W] on the way (the top-k keeps ties in index
    order); inputs the kernels do not take run the reference whole."""
    if not serves(q, keys, head_weights, visible):
        return index_topk_reference(q, keys, head_weights, visible, k)
    return top_k_in_order(index_scores_triton(q, keys, head_weights, visible), k)
