"""Gather Engram rows by id and dequantise them in one pass (Triton), with its torch reference.

An Engram row is 256 FP8 e4m3 codes plus 8 ue8m0 scale bytes (one power-of-two scale per 32
channels); a step reads up to 24 rows per token per Engram layer. The kernel reads the codes and
scales wherever they live (device memory, or host memory registered with ``cudaHostRegister`` and
read straight over PCIe: "zero-copy") and writes ``codes * scale`` as bf16/fp32.

Why the kernel looks the way it does (host memory; device memory is easy either way). Measured on
an H200 in a Firecracker VM, PCIe 5 x16, 55 GB/s pinned copy (``benchmarks/engram_fetch.py``):

* **Reads of scattered host rows are limited by address translation, not by request size.** At a
  fixed 262,144 rows, random rows confined to 64 MiB of the table come at 23 GB/s, spread over
  16 GiB at 5.5 GB/s; 2 MiB host pages change nothing, and neither does how the memory was
  allocated and mapped for the GPU (``cudaHostRegister``, ``cuMemHostAlloc``, or ``cuMemCreate`` host
  memory at 2 MiB granularity all read alike): the translation that misses is outside the guest, in
  the host IOMMU's 4 KiB view of guest memory (``benchmarks/engram_translation_probe.py``).
  Ordering the reads by address is what helps: sorted ids make consecutive reads share
  translations (17.7 GB/s at 524,288 sorted rows from 16 GiB, against 5.6 random).
* **A narrow window in flight.** Hence a *small* persistent grid (``max_programs``, default 32
  programs of 64 rows for host memory in :mod:`dsinfer.engram.fetch.host`): the rows in flight then sit
  in a short stretch of the sorted order. Thousands of programs spread the in-flight reads over
  the whole table and run slower (12.3 against 15.4 GB/s on sorted ids); a few programs also leave
  the SMs to the matrix multiplications a prefetch overlaps with.
* **16-byte loads, rows of two whole 128-byte lines.** ``row * 256`` is a multiple of 256 and the
  columns are contiguous, so each thread issues 16-byte loads (checked in the PTX). It is the
  economical choice, not the limiter: a byte-wise gather moves the same number of lines.
* **Codes and scales side by side.** The store keeps each row as a 264-byte record (codes, then
  scales; ``weight`` and ``scale`` are the two column ranges, row stride 264), so a row is one stretch
  of host memory and usually one page: 65,536 sorted rows of a 64 GiB table came at 9.4 GB/s, against
  7.1 GB/s from separate code and scale tables (1.09x at 524,288 rows). The row strides are
  compile-time constants, so Triton knows how every row is aligned.
* **Count read on the device.** The number of valid rows comes from a device tensor, so a
  de-duplicated id list whose length is only known on the GPU needs no host synchronisation.

:func:`dequantize_rows` runs the same kernel without the gather, on rows that already sit contiguously in
device memory: the staged host fetch (:mod:`dsinfer.engram.staged_gather`) copies the raw rows over first.

The reference (:func:`gather_dequantize_reference`) is ``dsinfer.ops.quant.dequantize_fp8_blockwise``
with 1x32 blocks; the kernel matches it bit for bit (an e4m3 value times a power of two is exact in
float32, and both round the same float32 to the output dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.quant import dequantize_fp8_blockwise
from dsinfer.ops.triton_support import (  # None without Triton: CPU installs use the reference
    tl,
    triton,
    triton_available,
)

__all__ = [
    "DEFAULT_BLOCK_ROWS",
    "DEFAULT_NUM_WARPS",
    "GatherLaunch",
    "dequantize_reference",
    "dequantize_rows",
    "gather_dequantize",
    "gather_dequantize_reference",
    "triton_available",
]

DEFAULT_BLOCK_ROWS = 32
DEFAULT_NUM_WARPS = 4
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GatherLaunch:
    """The kernel's launch shape: ``block_rows`` rows (a power of two) per program step, ``num_warps``, and at
    most ``max_programs`` persistent programs (None: 16 per SM; host memory wants few, see the module docstring)."""

    block_rows: int = DEFAULT_BLOCK_ROWS
    num_warps: int = DEFAULT_NUM_WARPS
    max_programs: int | None = None


def _check_tables(weight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    if weight.dtype not in (torch.uint8, torch.float8_e4m3fn) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D uint8 / float8_e4m3fn table, got {weight.dtype} {tuple(weight.shape)}")
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu) or scale.dim() != 2:
        raise ValueError(f"scale must be a 2-D uint8 / float8_e8m0fnu table, got {scale.dtype} {tuple(scale.shape)}")
    if scale.shape[0] != weight.shape[0]:
        raise ValueError(f"weight has {weight.shape[0]} rows but scale has {scale.shape[0]}")
    row_bytes, scale_columns = weight.shape[1], scale.shape[1]
    if row_bytes % scale_columns:
        raise ValueError(f"row width {row_bytes} is not a multiple of the {scale_columns} scales per row")
    if weight.stride(1) != 1 or scale.stride(1) != 1 or weight.stride(0) < row_bytes or scale.stride(0) < scale_columns:
        raise ValueError(
            "weight and scale tables must have contiguous rows (contiguous tables, or column slices of one "
            f"record table), got strides {weight.stride()} and {scale.stride()}"
        )
    return row_bytes, scale_columns


def dequantize_reference(
    codes: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """Every row of ``codes`` [n, row_bytes] dequantised with its ``scales`` [n, scale_columns] (torch reference)."""
    row_bytes, scale_columns = _check_tables(codes, scales)
    if codes.shape[0] == 0:
        return torch.empty(0, row_bytes, dtype=out_dtype, device=codes.device)
    return dequantize_fp8_blockwise(
        codes.view(torch.float8_e4m3fn),
        scales.view(torch.float8_e8m0fnu),
        block=(1, row_bytes // scale_columns),
        dtype=out_dtype,
    )


def gather_dequantize_reference(
    weight: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``[len(ids), row_bytes]`` rows ``ids`` of the table, dequantised: ``code * 2**(scale_byte - 127)``."""
    _check_tables(weight, scale)
    ids = ids.reshape(-1).to(device=weight.device, dtype=torch.int64)
    return dequantize_reference(weight.index_select(0, ids), scale.index_select(0, ids), out_dtype)


if triton is not None:

    @triton.jit
    def _gather_dequantize_kernel(
        ids_ptr,
        count_ptr,
        weight_ptr,
        scale_ptr,
        out_ptr,
        ROW_BYTES: tl.constexpr,
        SCALE_COLUMNS: tl.constexpr,
        WEIGHT_ROW_STRIDE: tl.constexpr,
        SCALE_ROW_STRIDE: tl.constexpr,
        BLOCK_ROWS: tl.constexpr,
        GATHER: tl.constexpr,
    ):
        program = tl.program_id(0)
        programs = tl.num_programs(0)
        count = tl.load(count_ptr).to(tl.int32)
        # A row as [SCALE_COLUMNS, group]: each scale broadcasts over its own group without a reshape.
        columns = (
            tl.arange(0, SCALE_COLUMNS)[:, None] * (ROW_BYTES // SCALE_COLUMNS)
            + tl.arange(0, ROW_BYTES // SCALE_COLUMNS)[None, :]
        )
        scale_columns = tl.arange(0, SCALE_COLUMNS)[:, None]
        for first in range(program * BLOCK_ROWS, count, programs * BLOCK_ROWS):
            slots = first + tl.arange(0, BLOCK_ROWS)
            live = slots < count
            if GATHER:
                rows = tl.load(ids_ptr + slots, mask=live, other=0).to(tl.int64)
            else:  # the rows already sit in order: row i of the table is output row i
                rows = slots.to(tl.int64)
            live3 = live[:, None, None]
            codes = tl.load(
                weight_ptr + rows[:, None, None] * WEIGHT_ROW_STRIDE + columns[None, :, :], mask=live3, other=0
            )
            exponents = tl.load(
                scale_ptr + rows[:, None, None] * SCALE_ROW_STRIDE + scale_columns[None, :, :], mask=live3, other=127
            ).to(tl.int32)
            # ue8m0 byte e is 2**(e - 127): float32 bits e << 23, except e = 0 (2**-127, a subnormal) and 255 (NaN).
            bits = tl.where(exponents == 0, 0x00400000, exponents << 23)
            bits = tl.where(exponents == 255, 0x7FC00000, bits)
            scales = bits.to(tl.float32, bitcast=True)
            values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scales
            out_offsets = slots.to(tl.int64)[:, None, None] * ROW_BYTES + columns[None, :, :]
            tl.store(out_ptr + out_offsets, values.to(out_ptr.dtype.element_ty), mask=live3)


def gather_dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    ids: torch.Tensor,
    *,
    count: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    launch: GatherLaunch = GatherLaunch(),
) -> torch.Tensor:
    """Triton gather + dequantise of rows ``ids[:count]`` into ``out[:count]`` (CUDA tensors).

    ``weight`` [rows, 256] and ``scale`` [rows, 8] may be device memory or registered host memory
    seen through a CUDA tensor (:func:`dsinfer.engram.fetch.host_tensor`). ``count`` is an int64
    device tensor of one element (default: all of ``ids``); rows of ``out`` past it are left as
    they were. Ids are not range-checked here (the caller asserts on the device).
    """
    if ids.dim() != 1 or ids.dtype != torch.int64:
        raise ValueError(f"ids must be a 1-D int64 tensor, got {ids.dtype} {tuple(ids.shape)}")
    return _launch(weight, scale, ids, ids.numel(), count, out, out_dtype, launch)


def dequantize_rows(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    launch: GatherLaunch = GatherLaunch(),
) -> torch.Tensor:
    """Triton dequantisation of every row of ``codes`` [n, 256] with ``scales`` [n, 8] (CUDA tensors) into ``out``.

    Bit-identical to :func:`dequantize_reference`; the staged host fetch uses it once the raw rows
    are in device memory.
    """
    capacity = codes.shape[0] if codes.dim() == 2 else 0
    return _launch(codes, scales, None, capacity, None, out, out_dtype, launch)


def _launch(
    weight: torch.Tensor,
    scale: torch.Tensor,
    ids: torch.Tensor | None,
    capacity: int,
    count: torch.Tensor | None,
    out: torch.Tensor | None,
    out_dtype: torch.dtype,
    launch: GatherLaunch,
) -> torch.Tensor:
    """Validate and run :func:`_gather_dequantize_kernel` over ``capacity`` output rows (``ids=None``: no gather)."""
    if triton is None:
        raise RuntimeError("the Engram dequantisation kernel needs Triton; use the torch reference on this install")
    row_bytes, scale_columns = _check_tables(weight, scale)
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    block_rows, max_programs = launch.block_rows, launch.max_programs
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    if out is None:
        out = torch.empty(capacity, row_bytes, dtype=out_dtype, device=weight.device if ids is None else ids.device)
    elif out.shape != (capacity, row_bytes) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{capacity}, {row_bytes}] tensor, got {tuple(out.shape)}")
    if capacity == 0:
        return out
    if count is None:
        count = torch.full((1,), capacity, dtype=torch.int64, device=out.device)
    blocks = triton.cdiv(capacity, block_rows)
    if max_programs is None:
        max_programs = torch.cuda.get_device_properties(out.device).multi_processor_count * 16
    grid = (max(1, min(blocks, max_programs)),)
    _gather_dequantize_kernel[grid](
        count if ids is None else ids,  # not read without a gather; any pointer will do
        count,
        weight,
        scale,
        out,
        ROW_BYTES=row_bytes,
        SCALE_COLUMNS=scale_columns,
        WEIGHT_ROW_STRIDE=weight.stride(0),
        SCALE_ROW_STRIDE=scale.stride(0),
        BLOCK_ROWS=block_rows,
        GATHER=ids is not None,
        num_warps=launch.num_warps,
    )
    return out
