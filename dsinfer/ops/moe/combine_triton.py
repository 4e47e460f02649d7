"""The routed experts' combine at many tokens: each token's ``k`` slot outputs summed in one Triton pass.

The down kernel stores one weighted row per slot ([T*k, H], slot ``t*k + j``); the token's output is their sum.
torch's ``view(T, k, H).sum(1)`` reduces over a strided middle axis at about half the copy bandwidth (106 us of
a 4,096-token chunk per layer on an H200, top-6). Here each program reads the ``k`` rows of one token's column
block and writes the sum once: float32 accumulation in slot order from the first slot, one rounding to the
output dtype. In bf16 (the engine's activations) that equals torch's sum on the H200 bit for bit; float32 sums
can differ from torch's in the last bit (its CUDA reduction takes another order).
"""

from __future__ import annotations

import torch

from dsinfer.ops.triton_support import tl, triton

BLOCK_COLUMNS = 1024


if triton is not None:

    @triton.jit
    def _sum_slots_kernel(slots, out, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        column = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = column < hidden
        first = slots + token * TOP_K * hidden
        total = tl.load(first + column, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(1, TOP_K):
            total += tl.load(first + j * hidden + column, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + token * hidden + column, total.to(out.dtype.element_ty), mask=mask)


def sum_slots(slots: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """``slots`` [tokens * top_k, H] (contiguous) -> [tokens, H]: each token's ``top_k`` rows summed."""
    hidden = slots.shape[-1]
    out = torch.empty(tokens, hidden, dtype=slots.dtype, device=slots.device)
    if tokens and hidden:
        block = min(BLOCK_COLUMNS, triton.next_power_of_2(hidden))
        _sum_slots_kernel[(tokens, triton.cdiv(hidden, block))](
            slots, out, hidden, TOP_K=top_k, BLOCK=block, num_warps=4
        )
    return out
