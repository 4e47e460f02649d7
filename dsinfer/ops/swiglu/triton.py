"""``clamped_swiglu`` in one Triton pass: the torch reference's clamp, clamp, SiLU and product are four kernels
and three intermediate tensors; at a decode step of one token they are four launches for a few KiB.

The SiLU is ``g / (1 + exp(-g))`` in float32, rounded to the input dtype before the product as torch rounds it;
Triton's ``exp`` may differ from torch's in the last float32 bit.
"""

from __future__ import annotations

import torch

from dsinfer.ops.dependent_launch import dependent_launch
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

if triton is not None:
    from dsinfer.ops.dependent_launch import allow_dependents

BLOCK = 1024


if triton is not None:

    @triton.jit
    def _swiglu_kernel(gate_up_ptr, out_ptr, inter, stride_row, limit, BLOCK: tl.constexpr, PDL: tl.constexpr):
        allow_dependents(PDL)
        row = tl.program_id(0).to(tl.int64)
        column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = column < inter
        dtype = out_ptr.dtype.element_ty
        gate = tl.load(gate_up_ptr + row * stride_row + column, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * stride_row + inter + column, mask=ok, other=0.0).to(tl.float32)
        gate = tl.minimum(gate, limit).to(dtype).to(tl.float32)
        up = tl.minimum(tl.maximum(up, -limit), limit).to(dtype).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + row * inter + column, (activated * up).to(dtype), mask=ok)


@register("clamped_swiglu", "triton", devices=("cuda",), available=triton_available, priority=10)
def clamped_swiglu_triton(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """Same contract as ``clamped_swiglu_reference``; inputs the kernel does not take go to the reference."""
    if gate_up.dim() != 2 or gate_up.stride(1) != 1 or gate_up.shape[1] % 2 or gate_up.requires_grad:
        from dsinfer.ops.swiglu.reference import clamped_swiglu_reference

        return clamped_swiglu_reference(gate_up, limit)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows and inter:
        grid = (rows, triton.cdiv(inter, BLOCK))
        _swiglu_kernel[grid](
            gate_up,
            out,
            inter,
            gate_up.stride(0),
            float(limit),
            PDL=dependent_launch(gate_up.device),
            BLOCK=BLOCK,
            num_warps=4,
        )
    return out
