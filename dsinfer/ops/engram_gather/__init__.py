"""``engram_gather(weight, scale, ids, out_dtype)``: Engram table rows by id, dequantised (FP8 codes x ue8m0 scales).

The reference and the Triton kernel live in :mod:`dsinfer.ops.engram_gather.kernel` (the host fetchers drive the kernel
directly, with its launch options); here both register as the op's backends.
"""

from __future__ import annotations

import torch

from dsinfer.ops.engram_gather.kernel import GatherLaunch, gather_dequantize, gather_dequantize_reference
from dsinfer.ops.registry import REFERENCE, register
from dsinfer.ops.triton_support import triton_available

register("engram_gather", REFERENCE)(gather_dequantize_reference)


@register("engram_gather", "triton", devices=("cuda",), available=triton_available)
def engram_gather_triton(
    weight: torch.Tensor,
    scale: torch.Tensor,
    ids: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    max_programs: int | None = None,
) -> torch.Tensor:
    """The Triton gather + dequantise of every id (the reference's signature; ``max_programs`` None: 16 per SM)."""
    ids = ids.reshape(-1).to(torch.int64)
    return gather_dequantize(weight, scale, ids, out_dtype=out_dtype, launch=GatherLaunch(max_programs=max_programs))


__all__ = ["engram_gather_triton", "gather_dequantize_reference"]
