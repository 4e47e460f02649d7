"""Bulk prefetches of weight bytes into L2 (sm_90's ``cp.async.bulk.prefetch.L2``), issued by a kernel before it
waits for the kernel ahead of it.

A decode step at one token is a chain of kernels that each read a weight once. A weight never depends on the step,
so a kernel launched as a programmatic dependent (:mod:`dsinfer.ops.dependent_launch`) may name the bytes it is
going to read while the kernel ahead still runs: one bulk prefetch instruction fetches a whole byte range into L2,
taking no registers and no shared memory and returning nothing. When the wait ends the kernel reads those bytes
from L2, so the memory's idle time under the kernels ahead (norms, mHC, attention: short, latency-bound) goes to
the next weight. A prefetch changes no value: the kernel reads the same bytes either way.

:func:`prefetch_rows` takes a program's rows: their first byte's addresses (16-byte aligned) and a byte count per
row (a multiple of 16), split into ``CHUNKS`` ranges a row, so that a program's threads issue distinct ranges.
:func:`prefetch_range` takes one contiguous range of elements (a tile of whole rows), also as ``CHUNKS`` ranges.
A kernel that cannot name its weight before its wait (the routed experts: the router picks them) still gains by
prefetching its whole tile at its start: every byte is requested at once, not one step ahead.
``ON`` False compiles to nothing: GPUs before sm_90, Triton's interpreter, and ``DSINFER_L2_PREFETCH=0``
(:func:`l2_prefetch`) get that.
"""

from __future__ import annotations

import functools
import os

import torch

from dsinfer.ops.inline_ptx import inline_ptx_available

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

DEFAULT_ON = True
ALIGNMENT = 16  # bytes: a bulk prefetch's address and size


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def l2_prefetch(device: torch.device) -> bool:
    """Whether kernels on ``device`` prefetch their weights into L2: a CUDA device of sm_90+ that runs inline PTX
    and ``DSINFER_L2_PREFETCH`` not ``0`` (unset: :data:`DEFAULT_ON`)."""
    setting = os.environ.get("DSINFER_L2_PREFETCH", "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"DSINFER_L2_PREFETCH must be 0 or 1, not {setting!r}")
    if triton is None or not inline_ptx_available(device):
        return False
    wanted = DEFAULT_ON if setting == "" else setting == "1"
    return wanted and _capable(device.index if device.index is not None else torch.cuda.current_device())


def rows_prefetchable(weight: torch.Tensor) -> bool:
    """Whether a weight's rows (its last axis) lie back to back, each starting 16-byte aligned: contiguous, its
    first byte and its row's bytes multiples of 16. Then any run of whole rows is one range of whole units."""
    row_bytes = weight.shape[-1] * weight.element_size() if weight.dim() else 0
    return weight.is_contiguous() and weight.data_ptr() % ALIGNMENT == 0 and row_bytes % ALIGNMENT == 0


if triton is not None:

    @triton.jit
    def _bulk_prefetch(start, nbytes):
        """One ``cp.async.bulk.prefetch.L2`` of ``nbytes`` at ``start`` per element (none where ``nbytes`` <= 0)."""
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [start, nbytes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit
    def prefetch_rows(row_starts, row_bytes, CHUNKS: tl.constexpr, ON: tl.constexpr):
        """Prefetch ``row_bytes`` bytes (a multiple of 16; <= 0: nothing) from each of ``row_starts`` ([R] byte
        pointers, 16-byte aligned) into L2, as ``CHUNKS`` ranges a row."""
        if ON:
            chunk = tl.cdiv(tl.cdiv(row_bytes, CHUNKS), 16) * 16
            offsets = tl.arange(0, CHUNKS) * chunk
            sizes = tl.minimum(chunk, row_bytes - offsets)
            starts = row_starts[:, None] + offsets[None, :]
            _bulk_prefetch(starts, tl.broadcast_to(sizes[None, :], starts.shape))

    @triton.jit
    def prefetch_range(start, count, CHUNKS: tl.constexpr, ON: tl.constexpr):
        """Prefetch ``count`` elements (whole 16-byte units; <= 0: nothing) from ``start`` (a scalar pointer,
        16-byte aligned) into L2, as ``CHUNKS`` ranges."""
        if ON:
            ELEMENT: tl.constexpr = start.dtype.element_ty.primitive_bitwidth // 8
            UNIT: tl.constexpr = 16 // ELEMENT  # elements of a 16-byte unit
            chunk = tl.cdiv(tl.cdiv(count, CHUNKS), UNIT) * UNIT
            offsets = tl.arange(0, CHUNKS) * chunk
            sizes = (tl.minimum(chunk, count - offsets) * ELEMENT).to(tl.int32)
            _bulk_prefetch(start + offsets, sizes)
