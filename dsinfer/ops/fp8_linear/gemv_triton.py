"""``fp8_linear`` for one token: a GEMV on the CUDA cores over the e4m3 codes, no ``tl.dot``.

At one token the ``tl.dot`` kernel (:mod:`dsinfer.ops.fp8_linear.triton`) pads the token to a 16-row tile and stages
every weight tile through shared memory for the tensor cores. Here a program owns ``BLOCK_N`` weight rows and walks
its split of the input in ``BLOCK_K`` columns. Each thread loads 16 code bytes at a time, and the loads of the next
step are issued before the current step is multiplied (one step ahead, in registers). The weight is cast to
float32 and multiplied by the activation times its column's scale; each thread adds the 16 products of its load
into a ``[BLOCK_N, BLOCK_K / 16]`` float32 accumulator (within the thread: no shuffles), which is summed over its
columns once at the end.

The scale: a program's rows lie in one scale block of rows (``BLOCK_N`` divides ``SCALE_ROWS``), so a column's scale
is the same for all of them and joins the activation: ``x * s`` is exact (a power of two), and ``w * (x * s)``
rounds as ``(w * s) * x`` does. The result differs from the reference (dequantise, then ``F.linear``) only in the
order of float32 additions. Splits of the input columns (small weights need them for enough programs) add up as
in the ``tl.dot`` kernel: the last split of a tile to arrive adds the splits in order.

On sm_90+ the GEMV launches as a programmatic dependent (:mod:`dsinfer.ops.dependent_launch`): it lets the next
kernel launch, issues its first step's weight loads (codes and scales, which no kernel of a step writes), and only
then waits for the kernel ahead before it reads its input. On the H200 that took the V4 slice's one-request step
with its FP8 linears kept from 1.082 to 1.065 ms (docs/perf.md, pass 10).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer import envs
from dsinfer.ops.dependent_launch import launch_options
from dsinfer.ops.fp8_linear.launch import choose_splits, hardware_fp8, kernel_operands, plan_splits, scale_operand
from dsinfer.ops.fp8_linear.reference import Fp8Weight
from dsinfer.ops.triton_support import tl, triton

if triton is not None:
    from dsinfer.ops.cache_codec.triton import e4m3_value, ue8m0_value
    from dsinfer.ops.dependent_launch import allow_dependents, wait_for_prerequisite


@dataclass(frozen=True)
class Fp8GemvConfig:
    """One launch shape: weight rows per program, input columns per step (a multiple of 16), warps, splits of the
    input columns (0: as :func:`~dsinfer.ops.fp8_linear.launch.choose_splits` says for ``programs_per_sm``)."""

    block_n: int
    block_k: int
    warps: int
    splits: int = 0
    programs_per_sm: int = 8

    def __post_init__(self) -> None:
        if self.block_k % 16:
            raise ValueError(f"the GEMV's block_k must be a multiple of 16 (a thread's load), got {self.block_k}")


# The launches of the H200 sweep with every call reading a weight that is not in L2, as in a model's step
# (``benchmarks/fp8_linear_choice.py --sweep --gemv-only --tokens 1 --cold``, docs/perf.md, pass 11):
# four-warp programs of 8 rows and 1024-column steps (splits for two programs an SM) took V4-Flash's wo_b
# (4096 x 8192) in 0.0118 ms against 0.0155 for the earlier (8, 512, 2 warps, two an SM), the shared expert's
# w1 + w3 in 0.0065 against 0.0086 and its w2 in 0.0040 against 0.0050; at V4.1-Flash's widths main_proj in 0.0287
# against 0.0359 and wo_b in 0.0167 against 0.0202. The earlier launch stays the fastest on the grouped wo_a (eight
# groups of 1024 x 4096: 0.0114 ms), so grouped weights keep it. On V4.1's Engram wkv (25600 x 6144) the fastest
# three launches took 512-column steps (four warps: 0.0469 ms), so weights of at least TALL_ROWS rows take that.
# (The ninth pass's sweep called one weight ten times a graph; weights under L2's 50 MB were then read mostly from
# L2 and favoured the smaller launch.) The GEMV takes weights of up to GEMV_MAX_WEIGHT elements, and larger ones
# whose rows are at least GEMV_MIN_INPUTS long: on a weight of many short rows (wq_b + the indexer's wq_b,
# 40960 x 1024) the split tl.dot kernel is faster ($DSINFER_FP8_GEMV_MAX_WEIGHT=0 turns the GEMV off).
DEFAULT_GEMV = Fp8GemvConfig(8, 1024, 4, 0, 2)
GROUPED_GEMV = Fp8GemvConfig(8, 512, 2, 0, 2)
TALL_GEMV = Fp8GemvConfig(8, 512, 4, 0, 2)
TALL_ROWS = 16384
GEMV_MAX_WEIGHT = 1 << 23
GEMV_MIN_INPUTS = 2048


def default_gemv(rows: int, groups: int) -> Fp8GemvConfig:
    """The launch for a weight of ``rows`` output rows in ``groups`` groups (the sweep's fastest for its kind)."""
    if groups > 1:
        return GROUPED_GEMV
    return TALL_GEMV if rows >= TALL_ROWS else DEFAULT_GEMV


def gemv_max_weight() -> int:
    setting = envs.FP8_GEMV_MAX_WEIGHT.get()
    return GEMV_MAX_WEIGHT if setting is None else setting


def gemv_serves(x: torch.Tensor, weight: Fp8Weight, groups: int, config=None) -> bool:
    """Whether the GEMV takes a one-token call whose other inputs the ``tl.dot`` kernel takes: a weight of at most
    :func:`gemv_max_weight` elements, or a larger one of rows at least GEMV_MIN_INPUTS long (while that limit is
    not 0); a program's rows (``config``, else the launch :func:`default_gemv` picks) in one scale block of rows and
    in one group."""
    codes = weight.codes
    config = config or default_gemv(codes.shape[0], groups)
    tokens = x.numel() // max(1, x.shape[-1])
    rows_per_group = codes.shape[0] // groups
    limit = gemv_max_weight()
    if tokens != 1 or limit == 0 or (codes.numel() > limit and codes.shape[1] < GEMV_MIN_INPUTS):
        return False
    return weight.block[0] % config.block_n == 0 and rows_per_group % config.block_n == 0


if triton is not None:

    @triton.jit
    def _weight_loads(code_rows, scale_row, cols, k_stop, SCALE_COLS: tl.constexpr):
        ok = cols < k_stop
        byte = tl.load(code_rows + cols[None, :], mask=ok[None, :], other=0)
        s = tl.load(scale_row + cols // SCALE_COLS, mask=ok, other=0)
        return byte, s

    @triton.jit
    def _gemv_loads(x_row, code_rows, scale_row, cols, k_stop, SCALE_COLS: tl.constexpr):
        byte, s = _weight_loads(code_rows, scale_row, cols, k_stop, SCALE_COLS)
        xv = tl.load(x_row + cols, mask=cols < k_stop, other=0.0)
        return byte, xv, s

    @triton.jit
    def _accumulate(acc, byte, xv, s, HARDWARE_FP8: tl.constexpr, SCALE_BYTES: tl.constexpr):
        """``acc`` plus one step: the e4m3 weights times the activations times their columns' scales."""
        if HARDWARE_FP8:
            w = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            w = e4m3_value(byte.to(tl.int32))
        if SCALE_BYTES:
            scaled = xv.to(tl.float32) * ue8m0_value(s.to(tl.int32))
        else:
            scaled = xv.to(tl.float32) * s
        products = w * scaled[None, :]  # 16 columns a thread (its 16-byte load): their sum stays in the thread
        return acc + tl.sum(tl.reshape(products, (products.shape[0], products.shape[1] // 16, 16)), axis=2)

    @triton.jit
    def _fp8_gemv_kernel(
        x_ptr,
        codes_ptr,  # uint8 [N, K]: e4m3 bytes
        scale_ptr,  # [ceil(N / SCALE_ROWS), scale_cols]: ue8m0 bytes or float32
        out_ptr,
        partial_ptr,  # float32 [splits, N] (SPLIT_K)
        arrived_ptr,  # int32 [tiles] (SPLIT_K)
        N,
        K,
        rows_per_group,
        scale_cols,
        splits,
        k_per_split,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SCALE_ROWS: tl.constexpr,
        SCALE_COLS: tl.constexpr,
        SCALE_BYTES: tl.constexpr,
        HARDWARE_FP8: tl.constexpr,
        SPLIT_K: tl.constexpr,
        PDL: tl.constexpr,  # a programmatic dependent: the first step's weight loads come before the wait
    ):
        allow_dependents(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        first_row = pid_n * BLOCK_N
        rows = first_row + tl.arange(0, BLOCK_N)
        group = first_row // rows_per_group
        x_row = x_ptr + group * K
        code_rows = codes_ptr + rows.to(tl.int64)[:, None] * K
        scale_row = scale_ptr + (first_row // SCALE_ROWS) * scale_cols
        k_start = pid_k * k_per_split
        k_stop = tl.minimum(K, k_start + k_per_split)
        acc = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
        cols = k_start + tl.arange(0, BLOCK_K)
        byte, s = _weight_loads(code_rows, scale_row, cols, k_stop, SCALE_COLS)
        wait_for_prerequisite(PDL)
        xv = tl.load(x_row + cols, mask=cols < k_stop, other=0.0)
        for _ in range(k_start, k_stop, BLOCK_K):
            cols += BLOCK_K
            next_byte, next_xv, next_s = _gemv_loads(x_row, code_rows, scale_row, cols, k_stop, SCALE_COLS)
            acc = _accumulate(acc, byte, xv, s, HARDWARE_FP8, SCALE_BYTES)
            byte, xv, s = next_byte, next_xv, next_s
        out = tl.sum(acc, axis=1)
        if SPLIT_K:
            tl.store(partial_ptr + pid_k.to(tl.int64) * N + rows, out)
            tl.debug_barrier()
            if tl.atomic_add(arrived_ptr + pid_n, 1) == splits - 1:
                out = tl.zeros((BLOCK_N,), dtype=tl.float32)
                for split in range(0, splits):
                    out += tl.load(partial_ptr + (split * N + rows).to(tl.int64), cache_modifier=".cg")
                tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty))
                tl.atomic_xchg(arrived_ptr + pid_n, 0)
        else:
            tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty))


def fp8_gemv(
    x: torch.Tensor, weight: Fp8Weight, dtype: torch.dtype, groups: int = 1, config: Fp8GemvConfig | None = None
) -> torch.Tensor:
    """``fp8_linear`` of one token (``x`` [..., groups * in] with one row; :func:`gemv_serves` must hold)."""
    codes, scale, block = weight.codes, weight.scale, weight.block
    config = config or default_gemv(codes.shape[0], groups)
    lead, (rows, inputs) = x.shape[:-1], codes.shape
    flat, out, work = kernel_operands(x, rows, inputs, dtype)
    if not work:
        return out.reshape(*lead, rows)
    tiles = rows // config.block_n
    wanted = config.splits or choose_splits(tiles, inputs, config.block_k, x.device, config.programs_per_sm)
    splits, k_per_split, arrived, partial = plan_splits(x.device, tiles, inputs, config.block_k, wanted, (rows,))
    scale_codes, scale_bytes = scale_operand(scale)
    dependent = launch_options(x.device)  # read once: the constexpr and the launch must agree
    _fp8_gemv_kernel[(tiles, splits)](
        flat, codes.view(torch.uint8), scale_codes, out, partial, arrived, rows,
        inputs, rows // groups, scale.shape[1], splits, k_per_split, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, SCALE_ROWS=block[0], SCALE_COLS=block[1], SCALE_BYTES=scale_bytes,
        HARDWARE_FP8=hardware_fp8(x.device), SPLIT_K=splits > 1, PDL=bool(dependent),
        num_warps=config.warps, num_stages=1, **dependent,
    )  # fmt: skip
    return out.reshape(*lead, rows)
