"""The Engram gate in one Triton kernel: one program per (token, stream).

The torch reference runs about twenty-five kernels (casts, squares, means, rsqrts, the weighted product and its
sum, the signed square root, the sigmoid, the broadcast write) over [T, hc, hidden] float32 temporaries. Here a
program walks its stream's hidden axis twice: first the three float32 sums (h^2, k^2, h * weight * k), then
``h + gate * value`` written in the streams' dtype. The sums run in another order than torch's, so results agree
to float32 rounding before the final cast (``tests/ops/test_engram_gate.py``).
"""

from __future__ import annotations

import torch

from dsinfer.ops.engram_gate.reference import GATE_MAGNITUDE_FLOOR, EngramGateInputs, engram_gate_reference
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

BLOCK = 1024  # hidden channels per step of a program's walk

if triton is not None:

    @triton.jit
    def _engram_gate_kernel(streams_ptr, key_ptr, value_ptr, weight_ptr, mask_ptr, out_ptr, hidden, eps, floor,
                            inv_sqrt_hidden, stride_st, stride_sc, stride_kt, stride_kc, stride_vt, stride_wc,
                            HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        stream = tl.program_id(1).to(tl.int64)
        h_row = streams_ptr + token * stride_st + stream * stride_sc
        k_row = key_ptr + token * stride_kt + stream * stride_kc
        w_row = weight_ptr + stream * stride_wc
        h_squares = tl.zeros([BLOCK], dtype=tl.float32)
        k_squares = tl.zeros([BLOCK], dtype=tl.float32)
        products = tl.zeros([BLOCK], dtype=tl.float32)
        for first in range(0, hidden, BLOCK):
            channel = first + tl.arange(0, BLOCK)
            ok = channel < hidden
            h = tl.load(h_row + channel, mask=ok, other=0.0).to(tl.float32)
            k = tl.load(k_row + channel, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(w_row + channel, mask=ok, other=0.0).to(tl.float32)
            h_squares += h * h
            k_squares += k * k
            products += h * w * k
        rstd = 1.0 / tl.sqrt_rn(tl.sum(h_squares, axis=0) / hidden + eps)
        rstd = rstd / tl.sqrt_rn(tl.sum(k_squares, axis=0) / hidden + eps)
        dot = tl.sum(products, axis=0) * rstd * inv_sqrt_hidden
        magnitude = tl.sqrt_rn(tl.maximum(tl.abs(dot), floor))
        gate = 1.0 / (1.0 + tl.exp(-tl.where(dot < 0, -magnitude, magnitude)))
        if HAS_MASK:
            gate = tl.where(tl.load(mask_ptr + token) != 0, gate, 0.0)
        out_row = out_ptr + token * stride_st + stream * stride_sc
        for first in range(0, hidden, BLOCK):
            channel = first + tl.arange(0, BLOCK)
            ok = channel < hidden
            h = tl.load(h_row + channel, mask=ok, other=0.0).to(tl.float32)
            v = tl.load(value_ptr + token * stride_vt + channel, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_row + channel, (h + gate * v).to(out_ptr.dtype.element_ty), mask=ok)


@register("engram_gate", "triton", devices=("cuda",), available=triton_available, priority=10)
def engram_gate_triton(inputs: EngramGateInputs) -> torch.Tensor:
    """Same contract as the reference; layouts the kernel does not take go to it."""
    streams, key, value, gate_mask, eps = inputs.streams, inputs.key, inputs.value, inputs.gate_mask, inputs.eps
    if streams.dim() != 3 or key.shape != streams.shape or min(t.stride(-1) for t in (streams, key, value)) != 1:
        return engram_gate_reference(inputs)
    streams = streams.contiguous()
    weight = inputs.weight.float().contiguous()
    tokens, streams_count, hidden = streams.shape
    out = torch.empty_like(streams)
    if streams.numel() == 0:
        return out
    mask = streams if gate_mask is None else gate_mask.contiguous().view(torch.uint8)
    _engram_gate_kernel[(tokens, streams_count)](
        streams, key, value, weight, mask, out, hidden, eps, GATE_MAGNITUDE_FLOOR, hidden**-0.5,
        streams.stride(0), streams.stride(1), key.stride(0), key.stride(1), value.stride(0), weight.stride(0),
        HAS_MASK=gate_mask is not None, BLOCK=min(BLOCK, triton.next_power_of_2(hidden)), num_warps=4,
    )  # fmt: skip
    return out
