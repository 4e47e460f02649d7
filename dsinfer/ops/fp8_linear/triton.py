"""``fp8_linear`` in Triton: the weight is read as its e4m3 codes (one byte an element, half of bf16's) and its ue8m0
block scales, never dequantised into memory, for the few-token GEMMs of a decode step.

One token takes the CUDA-core GEMV of :mod:`dsinfer.ops.fp8_linear.gemv_triton`. Otherwise a program owns
``BLOCK_N`` weight rows (output columns) and every token of the step (``BLOCK_M`` >= the tokens,
at most :data:`MAX_KERNEL_TOKENS`). It walks the input in ``BLOCK_K`` columns, one scale block at a time: the
codes are cast to the compute dtype (exact: e4m3 values are bf16 / fp16 values), one ``tl.dot`` forms the
block's partial sums in float32, and the partial is multiplied by the rows' block scales (powers of two: exact)
before it joins the accumulator. So the result differs from the reference (dequantise, then ``F.linear``) only in
the order of float32 additions. A grouped projection (``groups`` > 1, the attention's ``wo_a``) reads each run of
rows against its own run of input columns.

Steps of more tokens are GEMMs that tensor cores serve better from a bf16 weight: :func:`dequantize_fp8_triton`
writes it (one pass: a byte read, two written an element) and cuBLAS multiplies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer import envs
from dsinfer.ops.fp8_linear.gemv_triton import fp8_gemv, gemv_serves
from dsinfer.ops.fp8_linear.launch import (
    choose_splits,
    hardware_fp8,
    kernel_operands,
    plan_splits,
    scale_operand,
)
from dsinfer.ops.fp8_linear.reference import Fp8Weight, check_groups, fp8_linear_reference
from dsinfer.ops.grouped_linear import grouped_linear
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

if triton is not None:
    from dsinfer.ops.cache_codec.triton import e4m3_value, ue8m0_value

# Steps of up to this many tokens read the codes in the kernel; more go through a dequantised weight and cuBLAS
# ($DSINFER_FP8_KERNEL_MAX_TOKENS, 0: never the kernel). On the H200 the kernel's layer of linears took 0.122 ms
# at 32 tokens against 0.180 at 64, where the dequantised weight and cuBLAS take less (docs/perf.md, pass 8).
MAX_KERNEL_TOKENS = 32
_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class Fp8KernelConfig:
    """One launch shape: weight rows per program, input columns per step (divides the scale block), warps,
    pipeline stages, and how many programs split the input columns of a row tile (0: as :func:`choose_splits`
    says)."""

    block_n: int
    block_k: int
    warps: int
    stages: int
    splits: int = 0


def kernel_max_tokens() -> int:
    setting = envs.FP8_KERNEL_MAX_TOKENS.get()
    return MAX_KERNEL_TOKENS if setting is None else setting


def choose_config(rows: int, rows_per_group: int, block: tuple[int, int], tokens: int) -> Fp8KernelConfig:
    """The launch the sweep (``benchmarks/fp8_linear_choice.py --sweep``, H200) measured fastest at V4-Flash's
    shapes: steps of one 16-token block take programs of 32 weight rows; longer steps programs of 16 rows, or of
    64 rows and 64-column steps for the widest weights (the joined query projections); four warps, three stages.
    A width that does not divide the group's rows falls to 16 rows a program."""
    block_k = step_columns(block)
    if tokens <= 16:
        block_n = 32
    elif rows >= 32768:
        block_n, block_k = 64, min(block_k, 64)
    else:
        block_n = 16
    if rows_per_group % block_n:
        block_n = 16
    return Fp8KernelConfig(block_n, block_k, 4, 3)


def step_columns(block: tuple[int, int]) -> int:
    """Input columns a kernel step takes: the largest power of two up to 128 that divides the scale block's
    columns (so a step reads one scale a row)."""
    columns = 128
    while block[1] % columns:
        columns //= 2
    return columns


def serves(x: torch.Tensor, weight: Fp8Weight, dtype: torch.dtype, groups: int) -> bool:
    """Whether the kernel takes this call (else the reference's contract is served another way)."""
    codes, scale = weight.codes, weight.scale
    if x.dtype != dtype or dtype not in _COMPUTE_DTYPES or x.requires_grad or codes.dim() != 2:
        return False
    if codes.dtype != torch.float8_e4m3fn or not codes.is_contiguous() or not scale.is_contiguous():
        return False
    if scale.dtype not in (torch.float8_e8m0fnu, torch.float32) or x.device != codes.device:
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 9):
        return False  # the e4m3 cast is Triton's from sm_89
    return step_columns(weight.block) >= 16 and (codes.shape[0] // groups) % 16 == 0


if triton is not None:

    @triton.jit
    def _fp8_linear_kernel(
        x_ptr,
        codes_ptr,  # uint8 [N, K]: e4m3 bytes
        scale_ptr,  # [ceil(N / SCALE_ROWS), scale_cols]: ue8m0 bytes or float32
        out_ptr,
        partial_ptr,  # float32 [splits, M, N]: each split's sums (SPLIT_K)
        arrived_ptr,  # int32 [tiles]: splits done per output tile, back to 0 when the tile is written (SPLIT_K)
        M,
        N,
        K,
        rows_per_group,
        stride_xm,
        stride_om,
        scale_cols,
        splits,
        k_per_split,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SCALE_ROWS: tl.constexpr,
        SCALE_COLS: tl.constexpr,
        SCALE_BYTES: tl.constexpr,  # ue8m0 scales (else float32)
        HARDWARE_FP8: tl.constexpr,  # e4m3 bytes decoded by the float8 cast (sm_89+, the interpreter)
        IEEE: tl.constexpr,  # float32 inputs: a full-precision dot, not TF32
        SPLIT_K: tl.constexpr,  # more than one split: the last split of a tile to finish adds them up
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tokens = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < N
        token_ok = tokens < M
        group = (pid_n * BLOCK_N) // rows_per_group
        dtype = x_ptr.dtype.element_ty
        x_rows = x_ptr + tokens.to(tl.int64)[:, None] * stride_xm + group * K
        code_rows = codes_ptr + rows.to(tl.int64)[:, None] * K
        scale_rows = scale_ptr + (rows // SCALE_ROWS) * scale_cols
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_start = pid_k * k_per_split
        for k0 in range(k_start, tl.minimum(K, k_start + k_per_split), BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            a = tl.load(x_rows + cols[None, :], mask=token_ok[:, None] & col_ok[None, :], other=0.0)
            byte = tl.load(code_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0)
            if HARDWARE_FP8:
                w = byte.to(tl.float8e4nv, bitcast=True).to(dtype)
            else:
                w = e4m3_value(byte.to(tl.int32)).to(dtype)
            s = tl.load(scale_rows + k0 // SCALE_COLS, mask=row_ok, other=0)
            if SCALE_BYTES:
                s = ue8m0_value(s.to(tl.int32))
            if IEEE:
                part = tl.dot(a, tl.trans(w), input_precision="ieee")
            else:
                part = tl.dot(a, tl.trans(w))
            acc += part * s[None, :]
        ok = token_ok[:, None] & row_ok[None, :]
        if SPLIT_K:
            # Publish this split's sums, then count it in; the split that arrives last adds every split's sums in
            # split order (the same result whichever finishes last) and sets the count back for the next call.
            at = tokens.to(tl.int64)[:, None] * N + rows[None, :]
            tl.store(partial_ptr + pid_k.to(tl.int64) * M * N + at, acc, mask=ok)
            tl.debug_barrier()
            tile = pid_m * tl.num_programs(0) + pid_n
            if tl.atomic_add(arrived_ptr + tile, 1) == splits - 1:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for split in range(0, splits):
                    part_at = partial_ptr + (split * M + tokens).to(tl.int64)[:, None] * N + rows[None, :]
                    acc += tl.load(part_at, mask=ok, other=0.0, cache_modifier=".cg")
                out = out_ptr + tokens.to(tl.int64)[:, None] * stride_om + rows[None, :]
                tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)
                tl.atomic_xchg(arrived_ptr + tile, 0)
        else:
            out = out_ptr + tokens.to(tl.int64)[:, None] * stride_om + rows[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _dequantize_kernel(
        codes_ptr,
        scale_ptr,
        out_ptr,
        N,
        K,
        scale_cols,
        BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
        SCALE_ROWS: tl.constexpr,
        SCALE_COLS: tl.constexpr,
        SCALE_BYTES: tl.constexpr,
        HARDWARE_FP8: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = (rows < N)[:, None] & (cols < K)[None, :]
        at = rows.to(tl.int64)[:, None] * K + cols[None, :]
        byte = tl.load(codes_ptr + at, mask=ok, other=0)
        if HARDWARE_FP8:
            value = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            value = e4m3_value(byte.to(tl.int32))
        s = tl.load(scale_ptr + (rows // SCALE_ROWS)[:, None] * scale_cols + (cols // SCALE_COLS)[None, :], mask=ok)
        if SCALE_BYTES:
            s = ue8m0_value(s.to(tl.int32))
        tl.store(out_ptr + at, (value * s).to(out_ptr.dtype.element_ty), mask=ok)


def fp8_linear_kernel(
    x: torch.Tensor, weight: Fp8Weight, dtype: torch.dtype, groups: int = 1, config: Fp8KernelConfig | None = None
) -> torch.Tensor:
    """The kernel's ``fp8_linear`` for any number of tokens (callers keep it to few); ``config`` for sweeps."""
    check_groups(x, weight, groups)
    codes, scale, block = weight.codes, weight.scale, weight.block
    lead, (rows, inputs) = x.shape[:-1], codes.shape
    flat, out, work = kernel_operands(x, rows, inputs, dtype)
    if not work:
        return out.reshape(*lead, rows)
    tokens = flat.shape[0]
    rows_per_group = rows // groups
    config = config or choose_config(rows, rows_per_group, block, tokens)
    block_m = min(64, max(16, triton.next_power_of_2(tokens)))
    tiles = triton.cdiv(rows, config.block_n) * triton.cdiv(tokens, block_m)
    wanted = config.splits or choose_splits(tiles, inputs, config.block_k, x.device)
    splits, k_per_split, arrived, partial = plan_splits(x.device, tiles, inputs, config.block_k, wanted, (tokens, rows))
    scale_codes, scale_bytes = scale_operand(scale)
    grid = (triton.cdiv(rows, config.block_n), triton.cdiv(tokens, block_m), splits)
    _fp8_linear_kernel[grid](
        flat, codes.view(torch.uint8), scale_codes, out, partial, arrived,
        tokens, rows, inputs, rows_per_group, flat.stride(0), out.stride(0), scale.shape[1], splits, k_per_split,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SCALE_ROWS=block[0], SCALE_COLS=block[1],
        SCALE_BYTES=scale_bytes, HARDWARE_FP8=hardware_fp8(x.device), IEEE=dtype == torch.float32,
        SPLIT_K=splits > 1, num_warps=config.warps, num_stages=config.stages,
    )  # fmt: skip
    return out.reshape(*lead, rows)


def dequantize_fp8_triton(
    codes: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``dequantize_fp8_blockwise`` of a 2-D weight in one pass (the same values: exact products, one rounding)."""
    rows, inputs = codes.shape
    out = torch.empty(rows, inputs, dtype=dtype, device=codes.device)
    if out.numel() == 0:
        return out
    scale_codes, scale_bytes = scale_operand(scale)
    grid = (triton.cdiv(rows, 32), triton.cdiv(inputs, 128))
    _dequantize_kernel[grid](
        codes.view(torch.uint8), scale_codes, out, rows, inputs, scale.shape[1], BLOCK_R=32, BLOCK_C=128,
        SCALE_ROWS=block[0], SCALE_COLS=block[1], SCALE_BYTES=scale_bytes,
        HARDWARE_FP8=hardware_fp8(codes.device), num_warps=4,
    )  # fmt: skip
    return out


@register("fp8_linear", "triton", devices=("cuda",), available=triton_available, priority=10)
def fp8_linear_triton(x: torch.Tensor, weight: Fp8Weight, dtype: torch.dtype, groups: int = 1) -> torch.Tensor:
    """Same contract as ``fp8_linear_reference``: few tokens through the kernel, more through a dequantised
    weight (one Triton pass) and ``F.linear``; inputs neither takes go to the reference."""
    check_groups(x, weight, groups)
    if not serves(x, weight, dtype, groups):
        return fp8_linear_reference(x, weight, dtype, groups)
    tokens = x.numel() // max(1, x.shape[-1])
    if tokens <= kernel_max_tokens():
        kernel = fp8_gemv if tokens == 1 and gemv_serves(x, weight, groups) else fp8_linear_kernel
        return kernel(x, weight, dtype, groups)
    return grouped_linear(x, dequantize_fp8_triton(weight.codes, weight.scale, weight.block, dtype), groups)
