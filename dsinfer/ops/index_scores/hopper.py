"""The prefill index scores of shared keys on Hopper with the next head's MMA running beside this head's sums (Gluon).

The Triton kernel (:mod:`.triton`, shared keys) issues a head's products ``q[t, h] . k[w]`` on the warpgroup MMA
and waits for all of them before the ReLU and the weighted sum: compiled for sm_90 its head loop is 8
``HGMMA.64x64x16`` and then a wait for every one of them, then 32 ``FMNMX`` and 32 ``FFMA`` a thread, so the tensor
cores idle while a program sums. Plain Triton keeps the MMA synchronous even when the next head's product is
issued before this head's sums. Here the kernel is written in Gluon, Triton's layout-explicit dialect, which issues
the MMA asynchronously and waits for it by count:

* A program takes ``BLOCK_T`` = 64 queries x 128 entries a warpgroup (``WARPGROUPS`` of them, 2 by default: the
  program reads each query tile once for 256 entries, since a tile's 16 KiB from L2 a head are the kernel's
  largest traffic). The entries' keys sit in shared memory in the MMA's layout for the whole program (the B
  operand, read transposed); each head's query tile [64, 128] streams into a ring of ``NUM_STAGES`` shared-memory
  slots with ``cp.async``.
* Head ``h``'s MMA is issued asynchronously, then the kernel waits until only it is in flight, so head ``h - 1``'s
  products are ready: their ReLU, weight and sum run on the CUDA cores while head ``h``'s products run on the
  tensor cores. The slot head ``h - 1`` read is then refilled with head ``h - 1 + NUM_STAGES``'s queries.
* Two products (the one in flight and the one being summed) and the sum are 192 registers a thread: one program a
  multiprocessor at two warpgroups, two at one.

The grid, the tile skip past the tile's widest view, the -inf at invisible entries and the scale are the Triton
kernel's, and every product is the same exact bf16 product summed in fp32 in the same head order, so the scores
equal the Triton kernel's. ``index_scores_launch`` runs it for 16-bit queries and keys of 128 channels on sm_90
where Gluon is installed and the launch asks for it (``ScoresConfig.kernel == "gluon"``). Triton's interpreter does
not run Gluon: the kernel's tests run on CUDA (``tests/ops/test_index_scores_hopper_prefill.py``), and its sm_90 build
is checked on the CPU.
"""

from __future__ import annotations

import torch

from dsinfer.ops.gluon_support import (
    async_copy,
    block_barrier,
    copy_to_shared,
    fence_async_shared,
    gl,
    gluon,
    hopper_gluon_runs,
    warpgroup_mma,
    warpgroup_mma_wait,
)

BLOCK_T = 64  # queries a program: the warpgroup MMA's M
WARPGROUP_ENTRIES = 128  # entries a warpgroup: its MMA's N
HEAD_DIM = 128  # channels: the MMA's K
WARPGROUPS = 2  # a program's: each takes its 128 of the program's entries, all share its query tiles
NUM_STAGES = 4  # query tiles in flight a program (two warpgroups: nothing spilled)
HEADS_A_GROUP = 4  # heads a loop step: all but the last summed beside the next one's MMA

if gluon is not None:
    BLOCK_T_C = gl.constexpr(BLOCK_T)
    WARPGROUP_ENTRIES_C = gl.constexpr(WARPGROUP_ENTRIES)
    HEAD_DIM_C = gl.constexpr(HEAD_DIM)
    HEADS_A_GROUP_C = gl.constexpr(HEADS_A_GROUP)

    @gluon.jit
    def _issue_queries(ring, q_rows, query_ok, dims, head, n_heads, stride_qh, NUM_STAGES: gl.constexpr):
        """Start copying head ``head``'s query tile into its ring slot (nothing past the last head)."""
        live = head < n_heads
        copy_to_shared(ring.index(head % NUM_STAGES), q_rows + head * stride_qh + dims[None, :],
                       mask=query_ok[:, None] & live)  # fmt: skip
        async_copy.commit_group()

    @gluon.jit
    def _start_head(ring, keys_t, empty, head, NUM_STAGES: gl.constexpr, LATER: gl.constexpr):
        """Wait for head ``head``'s query tile (every copy group but the ``LATER`` issued after its own) and issue
        its products on the warpgroup MMA, asynchronously."""
        async_copy.wait_group(LATER)
        block_barrier()  # every lane's copies of the tile landed
        fence_async_shared()
        return warpgroup_mma(ring.index(head % NUM_STAGES), keys_t, empty, use_acc=False, is_async=True)

    @gluon.jit
    def _refill(ring, q_rows, q_ok, dims, head, n_heads, stride_qh, NUM_STAGES: gl.constexpr):
        """Once every warp's MMA of head ``head`` is done with its slot, copy head ``head + NUM_STAGES``'s queries
        into it."""
        block_barrier()
        _issue_queries(ring, q_rows, q_ok, dims, head + NUM_STAGES, n_heads, stride_qh, NUM_STAGES)

    @gluon.jit
    def _sum_head(acc, products, weight_rows, head, stride_wh, query_ok):
        """``acc`` plus head ``head``'s weighted ReLU products."""
        weight = gl.load(weight_rows + head * stride_wh, mask=query_ok, other=0.0).to(gl.float32)
        return acc + gl.maximum(products, 0.0) * weight[:, None]

    @gluon.jit
    def _hopper_shared_keys_kernel(
        q_ptr, keys_ptr, weights_ptr, visible_ptr, scores_ptr,
        n_queries, n_heads, width, stride_qt, stride_qh, stride_kw, stride_wt, stride_wh, stride_st, scale,
        NUM_STAGES: gl.constexpr, WARPGROUPS: gl.constexpr,
    ):  # fmt: skip
        """Scores [n, W] of queries [n, H, 128] against shared keys [W, 128] (16-bit, one dtype) on the Triton
        kernel's grid (entry tiles, query tiles)."""
        BLOCK_W: gl.constexpr = WARPGROUPS * WARPGROUP_ENTRIES_C
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, WARPGROUPS], instr_shape=[16, WARPGROUP_ENTRIES_C, 16]
        )
        ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
        COLUMNS: gl.constexpr = gl.SliceLayout(0, MMA)
        COPY: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4 * WARPGROUPS, 1], [1, 0])  # 16-byte copies
        SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16)
        dtype = q_ptr.dtype.element_ty

        first_entry = gl.program_id(0) * BLOCK_W
        first_query = gl.program_id(1) * BLOCK_T_C
        query = first_query + gl.arange(0, BLOCK_T_C, layout=ROWS)
        entry = first_entry + gl.arange(0, BLOCK_W, layout=COLUMNS)
        query_ok = query < n_queries
        count = gl.load(visible_ptr + query, mask=query_ok, other=0)
        most = gl.max(count, axis=0)  # the tile's widest view: entries past it are never read
        if first_entry < most:
            copy_rows = gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, COPY))
            dims = gl.arange(0, HEAD_DIM_C, layout=gl.SliceLayout(0, COPY))
            key_ok = (first_entry + copy_rows < width) & (first_entry + copy_rows < most)
            keys = gl.allocate_shared_memory(dtype, [BLOCK_W, HEAD_DIM_C], SMEM)
            ring = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_T_C, HEAD_DIM_C], SMEM)
            key_rows = keys_ptr + (first_entry + copy_rows).to(gl.int64)[:, None] * stride_kw + dims[None, :]
            copy_to_shared(keys, key_rows, mask=key_ok[:, None])  # joins head 0's group
            copy_query = first_query + gl.arange(0, BLOCK_T_C, layout=gl.SliceLayout(1, COPY))
            q_rows = q_ptr + copy_query.to(gl.int64)[:, None] * stride_qt
            q_ok = copy_query < n_queries
            for ahead in gl.static_range(NUM_STAGES):
                _issue_queries(ring, q_rows, q_ok, dims, ahead, n_heads, stride_qh, NUM_STAGES)
            weight_rows = weights_ptr + query.to(gl.int64) * stride_wt
            keys_t = keys.permute((1, 0))
            empty = gl.zeros([BLOCK_T_C, BLOCK_W], gl.float32, MMA)
            acc = gl.zeros([BLOCK_T_C, BLOCK_W], gl.float32, MMA)

            # Heads in groups of HEADS_A_GROUP: a head's products are summed while the next head's run on the
            # tensor cores (all but the group's last); no product in flight crosses the loop's back edge, whose
            # copy of the registers would make the compiler wait for every MMA. Head j's slot is refilled with
            # head j + NUM_STAGES once its MMA is done, so a group's first start waits for every copy group but the
            # NUM_STAGES - 1 issued after its own, the others for all but NUM_STAGES - 2.
            for group in range(0, n_heads // HEADS_A_GROUP_C):
                head = group * HEADS_A_GROUP_C
                running = _start_head(ring, keys_t, empty, head, NUM_STAGES, NUM_STAGES - 1)
                for step in gl.static_range(HEADS_A_GROUP_C):
                    if step + 1 < HEADS_A_GROUP_C:
                        following = _start_head(ring, keys_t, empty, head + step + 1, NUM_STAGES, NUM_STAGES - 2)
                        products = warpgroup_mma_wait(1, deps=[running])
                        running = following
                    else:
                        products = warpgroup_mma_wait(0, deps=[running])
                    _refill(ring, q_rows, q_ok, dims, head + step, n_heads, stride_qh, NUM_STAGES)
                    acc = _sum_head(acc, products, weight_rows, head + step, stride_wh, query_ok)
            async_copy.wait_group(0)  # the empty copies past the last head land before the program ends
            scores = gl.where(entry[None, :] < count[:, None], acc * scale, float("-inf"))
        else:
            scores = gl.full([BLOCK_T_C, BLOCK_W], float("-inf"), gl.float32, MMA)
        out = scores_ptr + query.to(gl.int64)[:, None] * stride_st + entry[None, :]  # made here: 128 registers
        gl.store(out, scores, mask=query_ok[:, None] & (entry < width)[None, :])


def hopper_shared_keys_fits(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the Gluon kernel takes these inputs: an sm_90 device with Gluon, shared keys [W, 128] and queries
    [n, H, 128] of one 16-bit dtype, heads a whole number of groups, rows 16-byte aligned (``cp.async`` copies 16
    bytes)."""
    if not hopper_gluon_runs(q.device):
        return False
    if keys.dim() != 2 or q.dim() != 3 or q.shape[-1] != HEAD_DIM or keys.shape[-1] != HEAD_DIM:
        return False
    if q.shape[1] % HEADS_A_GROUP or q.stride(-1) != 1 or keys.stride(-1) != 1:
        return False
    aligned = all(t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in t.stride()[:-1]) for t in (q, keys))
    return q.dtype == keys.dtype and q.dtype in (torch.bfloat16, torch.float16) and aligned


def hopper_shared_keys_launch(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_weights: torch.Tensor,
    visible: torch.Tensor,
    scores: torch.Tensor,
    num_stages: int = NUM_STAGES,
    warpgroups: int = WARPGROUPS,
) -> None:
    """Fill ``scores`` [n, W] from inputs :func:`hopper_shared_keys_fits` takes (``visible`` contiguous), with
    ``warpgroups`` x 128 entries a program (1 or 2)."""
    n_queries, n_heads, _ = q.shape
    width = keys.shape[0]
    grid = (-(-width // (warpgroups * WARPGROUP_ENTRIES)), -(-n_queries // BLOCK_T))
    _hopper_shared_keys_kernel[grid](
        q, keys, head_weights, visible, scores, n_queries, n_heads, width, q.stride(0), q.stride(1), keys.stride(0),
        head_weights.stride(0), head_weights.stride(1), scores.stride(0), HEAD_DIM**-0.5,
        NUM_STAGES=num_stages, WARPGROUPS=warpgroups, num_warps=4 * warpgroups,
    )  # fmt: skip
