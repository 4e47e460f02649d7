"""Decode attention in Triton: split-K over a sequence's window ring and compressed entries, then a combine.

The keys of one query token are its ``W`` window ring rows and its ``K`` selected compressed entries: tiles of
``BLOCK_N`` keys, the window's first (its last tile padded with masked rows), then the entries'. The first kernel
runs one program per (sequence, head group, split): it loads the query rows of ``BLOCK_H`` heads once, then walks
its share of the tiles in two loops, window and entries, each with one gather load that feeds both products
directly (so the compiler can stage it through shared memory and the registers hold only q, the accumulator and
one tile of logits). Every key is one
``D``-wide row that is key and value at once (shared-KV MQA), so each tile is loaded once and serves both
products of all heads of the group: ``q @ k^T`` for the logits and ``p @ k`` for the output. Window rows are
read from the ring at ``position % W``; entries through the block table (entry ``i`` of a sequence lives in
block ``table[i // per_block]``, row ``i % per_block``); masked keys cost no memory traffic. The softmax is
online (running max and sum in fp32, exp2 with log2(e) folded into the scale); the products accumulate in fp32.

With one split the program finishes the softmax itself, the sink joining the denominator. With several, each
stores its unnormalised output and its (max, sum) and the combine kernel merges them per (sequence, head)
starting from the sink's term, one program per (sequence, head block, channel block) (:func:`choose_combine`:
a small step splits the channels too, so one sequence's 64 x 512 outputs take 64 programs, not 4). The split
count comes from tensor shapes and the device's SM count only, so a step launches the same grids every time
(CUDA-graph capturable) and reads nothing on the host.

The sums run in another order than the reference's and the logits are not rounded to bf16 before the softmax,
so results agree with the reference to rounding, not bit for bit (``tests/ops/test_sparse_attention.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dsinfer.ops.registry import register
from dsinfer.ops.sparse_attention.reference import SparseDecodeInputs, sparse_attention_decode_reference
from dsinfer.ops.triton_support import tl, triton, triton_available

LOG2E = 1.4426950408889634
EMPTY_MAX = -1.0e30  # running max of a split that has seen no visible key (finite, so exp2 of differences is 0)
sparse_attention_triton_available = triton_available  # the name the indexer kernels still import


@dataclass(frozen=True)
class DecodeConfig:
    block_h: int = 16  # query heads per program (the M of both products; 16 is the smallest MMA)
    block_n: int = 32  # key slots per tile
    num_warps: int = 4
    num_stages: int = 2


TARGET_WAVES = 2  # aim for this many programs per SM when choosing the split count
MIN_TILES_PER_SPLIT = 1  # a split may be one tile: at a step of one or two sequences the chain of tiles is the cost
FEW_QUERY_HEADS = 128  # sequences x heads up to this: 16 heads a program (more programs for a small step)


def choose_config(n_heads: int, dtype: torch.dtype, head_dim: int = 512, batch: int | None = None) -> DecodeConfig:
    """The launch configuration by head count, dtype, width and (``batch``) sequences in the step
    (``benchmarks/attention_decode.py --sweep``).

    The fp32 accumulator of a program is ``block_h x head_dim``: with 512-d heads, 64 heads in one program need
    128 registers per thread for it alone at 8 warps and spill, so bf16 / fp16 take 32 heads per program
    (2 programs per sequence share each K=V tile through L2) and 8 warps; fewer heads, groups of 16 (the
    smallest MMA). fp32: the IEEE products run on CUDA cores; 16 x 16 tiles keep them in registers. A step of
    few query heads in all (``batch * n_heads <= FEW_QUERY_HEADS``: one or two V4 sequences) takes 16 heads a
    program, twice the programs: on the H200 at one sequence and 256 context a layer's call took 9.5 / 13.6 /
    11.2 us (window / CSA / HCA) against 14.0 / 25.0 / 17.8 us with 32 heads and at least four tiles a split.
    (sm_90 builds of these: no spills, ``tests/ops/test_sparse_attention.py``.)
    """
    wide = head_dim >= 256
    if dtype == torch.float32:
        return DecodeConfig(block_h=16, block_n=16, num_warps=8 if wide else 4, num_stages=2)
    if n_heads >= 32 and not (batch is not None and batch * n_heads <= FEW_QUERY_HEADS):
        return DecodeConfig(block_h=32, block_n=32, num_warps=8 if wide else 4, num_stages=2)
    return DecodeConfig(block_h=16, block_n=32, num_warps=8 if wide else 4, num_stages=2)


if triton is not None:

    @triton.jit
    def _step_origin(step_starts_ptr, step_first_ptr, seq, position, HAS_STEP: tl.constexpr):
        """Query ``seq``'s first verify-step position and its row among the step's rows (without step rows: past
        the query's own position, so every key is read from the ring)."""
        step_start, step_first = position + 1, 0
        if HAS_STEP:
            step_start = tl.load(step_starts_ptr + seq)
            step_first = tl.load(step_first_ptr + seq)
        return step_start, step_first

    @triton.jit
    def _step_rows(key_position, step_start, step_first):
        """Which keys of a tile a verify step's rows hold (its positions from ``step_start`` on) and their rows."""
        from_step = key_position >= step_start
        return from_step, tl.where(from_step, step_first + key_position - step_start, 0).to(tl.int64)

    @triton.jit
    def _attend_tile(q, kv, visible, running_max, running_sum, acc, scale_log2, PRECISION: tl.constexpr):
        """One tile of keys into the running softmax of every head of the group; kv [BLOCK_N, BLOCK_D]."""
        kv = kv.to(q.dtype)
        logits = tl.dot(q, tl.trans(kv), input_precision=PRECISION) * scale_log2
        logits = tl.where(visible[None, :], logits, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(logits - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(kv.dtype), kv, input_precision=PRECISION)
        return new_max, running_sum, acc

    @triton.jit
    def _decode_split_kernel(
        q_ptr,
        window_ptr,
        entries_ptr,
        slots_ptr,
        positions_ptr,
        window_from_ptr,
        tables_ptr,
        indices_ptr,
        step_ptr,
        step_starts_ptr,
        step_first_ptr,
        sink_ptr,
        out_ptr,
        part_out_ptr,
        part_max_ptr,
        part_sum_ptr,
        n_heads,
        n_indices,
        tiles_per_split,
        n_tiles,
        stride_qb,
        stride_qh,
        stride_ws,
        stride_ww,
        stride_eb,
        stride_ep,
        stride_sr,
        stride_tb,
        stride_ib,
        stride_ob,
        stride_oh,
        scale_log2,
        WINDOW: tl.constexpr,
        WINDOW_TILES: tl.constexpr,
        PER_BLOCK: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr,
        HAS_ENTRIES: tl.constexpr,
        HAS_STEP: tl.constexpr,  # a verify step's rows come from step_ptr (positions from the query's step start)
        PRECISION: tl.constexpr,
    ):
        # Key tiles: WINDOW_TILES of window rows (the last one padded with masked rows), then the entries'.
        seq = tl.program_id(0)
        group = tl.program_id(1)
        split = tl.program_id(2)
        heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < n_heads
        dims = tl.arange(0, BLOCK_D)
        if BLOCK_D == HEAD_DIM:  # row masks only: the loads stay vectorised along the row
            dim_ok = dims < BLOCK_D
        else:
            dim_ok = dims < HEAD_DIM
        q = tl.load(
            q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=head_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        position = tl.load(positions_ptr + seq)
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        oldest = tl.maximum(tl.maximum(position - WINDOW + 1, tl.load(window_from_ptr + seq)), 0)
        ring = window_ptr + slot * stride_ws
        step_start, step_first = _step_origin(step_starts_ptr, step_first_ptr, seq, position, HAS_STEP)

        running_max = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # EMPTY_MAX
        running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        first = split * tiles_per_split
        last = tl.minimum(first + tiles_per_split, n_tiles)
        for tile in range(first, tl.minimum(last, WINDOW_TILES)):
            key = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            key_position = position - WINDOW + 1 + key
            visible = (key < WINDOW) & (key_position >= oldest)
            row = key_position % WINDOW
            row = tl.where(row < 0, row + WINDOW, row)
            rows = ring + row[:, None] * stride_ww + dims[None, :]
            if HAS_STEP:  # the step's own positions from its rows, the earlier ones from the ring
                from_step, step_row = _step_rows(key_position, step_start, step_first)
                rows = tl.where(from_step[:, None], step_ptr + step_row[:, None] * stride_sr + dims[None, :], rows)
            kv = tl.load(rows, mask=visible[:, None] & dim_ok[None, :], other=0.0)
            running_max, running_sum, acc = _attend_tile(
                q, kv, visible, running_max, running_sum, acc, scale_log2, PRECISION
            )
        if HAS_ENTRIES:
            for tile in range(tl.maximum(first, WINDOW_TILES), last):
                entry = (tile - WINDOW_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
                index = tl.load(indices_ptr + seq * stride_ib + entry, mask=entry < n_indices, other=-1)
                visible = index >= 0
                block = tl.load(tables_ptr + seq * stride_tb + index // PER_BLOCK, mask=visible, other=0)
                row = block.to(tl.int64) * stride_eb + (index % PER_BLOCK).to(tl.int64) * stride_ep
                kv = tl.load(
                    entries_ptr + row[:, None] + dims[None, :], mask=visible[:, None] & dim_ok[None, :], other=0.0
                )
                running_max, running_sum, acc = _attend_tile(
                    q, kv, visible, running_max, running_sum, acc, scale_log2, PRECISION
                )

        out_mask = head_ok[:, None] & dim_ok[None, :]
        if SPLITS == 1:
            sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            top = tl.maximum(running_max, sink)
            weight = tl.exp2(running_max - top)
            total = running_sum * weight + tl.exp2(sink - top)
            result = acc * (weight / total)[:, None]
            tl.store(
                out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                result.to(out_ptr.dtype.element_ty),
                mask=out_mask,
            )
        else:
            row_id = (seq * SPLITS + split) * n_heads + heads  # partials [B, SPLITS, H, (D)]
            tl.store(part_max_ptr + row_id, running_max, mask=head_ok)
            tl.store(part_sum_ptr + row_id, running_sum, mask=head_ok)
            tl.store(part_out_ptr + row_id.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)

    @triton.jit
    def _decode_combine_kernel(
        part_out_ptr,
        part_max_ptr,
        part_sum_ptr,
        sink_ptr,
        out_ptr,
        n_heads,
        stride_ob,
        stride_oh,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_H: tl.constexpr,
        SPLITS: tl.constexpr,
    ):
        # One program: BLOCK_H heads x BLOCK_D channels of one sequence. Every channel block of a head repeats
        # the head's (max, sum) merge, the same operations in the same order, so the weights and the result of
        # each channel do not depend on how the channels are blocked.
        seq = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < n_heads
        dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = head_ok[:, None] & (dims < HEAD_DIM)[None, :]
        # The sink's term starts the merge: max = sink, sum = exp2(0) = 1, no output.
        top = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        total = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for split in range(SPLITS):
            row_id = (seq * SPLITS + split) * n_heads + heads
            part_max = tl.load(part_max_ptr + row_id, mask=head_ok, other=-1.0e30)
            part_sum = tl.load(part_sum_ptr + row_id, mask=head_ok, other=0.0)
            part = tl.load(part_out_ptr + row_id.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
            new_top = tl.maximum(top, part_max)
            old_weight = tl.exp2(top - new_top)
            part_weight = tl.exp2(part_max - new_top)
            total = total * old_weight + part_sum * part_weight
            acc = acc * old_weight[:, None] + part * part_weight[:, None]
            top = new_top
        result = acc / total[:, None]
        tl.store(
            out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=mask,
        )


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (host-known; 4 under the interpreter)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def choose_splits(batch: int, head_groups: int, n_tiles: int, sm_count: int) -> int:
    """Splits of the key slots per (sequence, head group): enough programs for ``TARGET_WAVES`` per SM, each
    split at least ``MIN_TILES_PER_SPLIT`` tiles."""
    most = max(1, n_tiles // MIN_TILES_PER_SPLIT)
    if most == 1:
        return 1
    programs = batch * head_groups
    wanted = max(1, math.ceil(TARGET_WAVES * sm_count / max(programs, 1)))
    splits = min(most, wanted)
    tiles_per_split = math.ceil(n_tiles / splits)
    return math.ceil(n_tiles / tiles_per_split)  # no split left without a tile


COMBINE_PROGRAMS = 256  # the combine splits its blocks while a step launches fewer programs than this
COMBINE_MIN_D = 64  # channels per combine program at the least (256 bytes of each fp32 row)
COMBINE_MIN_H = 8  # heads per combine program at the least (after the channels reach COMBINE_MIN_D)


@dataclass(frozen=True)
class CombineLaunch:
    """The combine's blocks: ``block_h`` heads x ``block_d`` channels a program, over ``grid`` (sequences, head
    blocks, channel blocks)."""

    block_h: int
    block_d: int
    grid: tuple[int, int, int]


def choose_combine(batch: int, n_heads: int, head_dim: int) -> CombineLaunch:
    """The combine's launch, from the shapes only: 16 heads by the whole (power-of-two padded) row a program,
    then, while ``batch x head blocks x channel blocks`` is under ``COMBINE_PROGRAMS``, half the channels (down
    to ``COMBINE_MIN_D``), then half the heads (down to ``COMBINE_MIN_H``). 64 heads x 512: one sequence, 64
    programs of 8 x 64 (16 x 512 blocks gave 4 programs, each looping over every split's 32 KiB tile: 5.5 us
    a V4 call and 9.6 us a V4.1 call on the H200; these blocks are not timed yet); 32 sequences, 256 programs
    of 16 x 256; 256 sequences, 1024 of 16 x 512. Each channel block repeats its heads' (max, sum) merge, two
    floats a head and split."""
    block_h = min(16, triton.next_power_of_2(n_heads))
    block_d = triton.next_power_of_2(head_dim)

    def programs() -> int:
        return batch * triton.cdiv(n_heads, block_h) * triton.cdiv(head_dim, block_d)

    while block_d > COMBINE_MIN_D and programs() < COMBINE_PROGRAMS:
        block_d //= 2
    while block_h > COMBINE_MIN_H and programs() < COMBINE_PROGRAMS:
        block_h //= 2
    return CombineLaunch(block_h, block_d, (batch, triton.cdiv(n_heads, block_h), triton.cdiv(head_dim, block_d)))


def combine_splits(
    part_out: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    sink: torch.Tensor,
    out: torch.Tensor,
    launch: CombineLaunch | None = None,
) -> None:
    """Merges the splits' partials (``part_out`` [B, S, H, D] fp32, contiguous; ``part_max`` / ``part_sum``
    [B, S, H]) with the sink into ``out`` [B, H, D] (unit channel stride), launched as ``launch`` (default
    :func:`choose_combine`); every launch gives the same bits (``sink`` [H], contiguous)."""
    batch, splits, n_heads, head_dim = part_out.shape
    launch = launch or choose_combine(batch, n_heads, head_dim)
    _decode_combine_kernel[launch.grid](
        part_out,
        part_max,
        part_sum,
        sink,
        out,
        n_heads,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=launch.block_d,
        BLOCK_H=launch.block_h,
        SPLITS=splits,
        num_warps=4,
    )


def _serves(q, window, entries, indices) -> bool:
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if q.stride(-1) != 1 or window.stride(-1) != 1 or window.shape[-1] != q.shape[-1]:
        return False
    if entries is not None and (entries.stride(-1) != 1 or entries.shape[-1] != q.shape[-1]):
        return False
    return indices is None or indices.dim() == 2


class SplitPlan(NamedTuple):
    """How a decode launch splits each sequence's keys: ``splits`` programs per (sequence, head group), each
    walking ``tiles_per_split`` of the ``n_tiles`` tiles (the window's ``window_tiles`` first, then the entries')."""

    head_groups: int
    window_tiles: int
    n_tiles: int
    tiles_per_split: int
    splits: int


def plan_splits(q: torch.Tensor, window_size: int, n_indices: int, config: DecodeConfig, num_splits: int | None):
    """The :class:`SplitPlan` of a decode launch over ``window_size`` ring rows and ``n_indices`` entries
    (``num_splits`` None: from the shapes and the SM count); every split walks at least one tile."""
    batch, n_heads = q.shape[0], q.shape[1]
    head_groups = triton.cdiv(n_heads, config.block_h)
    window_tiles = triton.cdiv(window_size, config.block_n)
    n_tiles = window_tiles + triton.cdiv(n_indices, config.block_n)
    splits = num_splits or choose_splits(batch, head_groups, n_tiles, _sm_count(q.device))
    splits = max(1, min(splits, n_tiles))
    tiles_per_split = triton.cdiv(n_tiles, splits)
    return SplitPlan(head_groups, window_tiles, n_tiles, tiles_per_split, triton.cdiv(n_tiles, tiles_per_split))


def split_partials(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The splits' partial outputs, maxima and sums for :func:`combine_splits` (one split: ``out``, unused)."""
    if splits == 1:
        return out, out, out
    batch, n_heads, head_dim = out.shape
    part_out = torch.empty(batch, splits, n_heads, head_dim, dtype=torch.float32, device=out.device)
    part_max = torch.empty(batch, splits, n_heads, dtype=torch.float32, device=out.device)
    return part_out, part_max, torch.empty_like(part_max)


def sparse_attention_decode_launch(
    inputs: SparseDecodeInputs, config: DecodeConfig | None = None, num_splits: int | None = None
) -> torch.Tensor:
    """The kernels, no fallback: ``config`` (default :func:`choose_config`) and ``num_splits`` (default: from the
    shapes and the SM count) fix the launch."""
    q, window, entries, indices = inputs.q, inputs.window, inputs.entries, inputs.indices
    batch, n_heads, head_dim = q.shape
    config = config or choose_config(n_heads, q.dtype, head_dim, batch)
    size = window.shape[1]
    has_entries = entries is not None and indices is not None and indices.shape[1] > 0
    n_indices = indices.shape[1] if has_entries else 0
    out = torch.empty_like(q)
    if batch == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs 16 along every axis
    plan = plan_splits(q, size, n_indices, config, num_splits)
    slots, positions, window_from, sink = (t.contiguous() for t in (inputs.slots, inputs.positions,
                                                                    inputs.window_from, inputs.sink))  # fmt: skip
    if has_entries:
        indices, tables = indices.contiguous(), inputs.block_tables.contiguous()
        entries_arg, per_block = entries, entries.shape[1]
        stride_eb, stride_ep = entries.stride(0), entries.stride(1)
    else:  # window only: the entry pointers are never read
        indices, tables, entries_arg, per_block, stride_eb, stride_ep = slots, slots, window, 1, 0, 0
    part_out, part_max, part_sum = split_partials(out, plan.splits)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    step = inputs.step
    if step is not None:  # the step's rows, in the ring's dtype
        step_rows, step_starts, step_first = step.rows.to(window.dtype), step.starts, step.first_rows
        step_starts, step_first = step_starts.contiguous(), step_first.contiguous()
    else:  # the step pointers are never read
        step_rows, step_starts, step_first = window, slots, slots
    _decode_split_kernel[(batch, plan.head_groups, plan.splits)](
        q, window, entries_arg, slots, positions, window_from, tables, indices, step_rows, step_starts, step_first,
        sink, out, part_out, part_max, part_sum, n_heads, n_indices, plan.tiles_per_split, plan.n_tiles, q.stride(0),
        q.stride(1), window.stride(0), window.stride(1), stride_eb, stride_ep, step_rows.stride(0), tables.stride(0),
        indices.stride(0), out.stride(0), out.stride(1), inputs.softmax_scale * LOG2E,
        WINDOW=size, WINDOW_TILES=plan.window_tiles, PER_BLOCK=per_block, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_H=config.block_h, BLOCK_N=config.block_n, SPLITS=plan.splits, HAS_ENTRIES=has_entries,
        HAS_STEP=step is not None, PRECISION=precision, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if plan.splits > 1:
        combine_splits(part_out, part_max, part_sum, sink, out)
    return out


@register(
    "sparse_attention_decode",
    "triton",
    devices=("cuda",),
    dtypes=(torch.float32, torch.bfloat16, torch.float16),
    available=triton_available,
    priority=10,
)
def sparse_attention_decode_triton(inputs: SparseDecodeInputs) -> torch.Tensor:
    """Same contract as the reference; inputs the kernel does not serve go to the reference (a kernel that fails
    to compile here falls back through the registry, :func:`dsinfer.ops.registry.falls_back_to_reference`)."""
    if not _serves(inputs.q, inputs.window, inputs.entries, inputs.indices):
        return sparse_attention_decode_reference(inputs)
    return sparse_attention_decode_launch(inputs)
