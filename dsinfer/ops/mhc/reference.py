"""The truth for mHC's stream collapse, expand and weight inputs: the torch expressions the models were validated
with.

Their dtype behaviour is part of the contract (the Triton backend is tested against it): the collapse multiplies
in the weights' float32 and rounds once to the streams' dtype; the expand casts ``post`` and ``comb`` to the
streams' dtype first, rounds the spread product and the mixing matmul each to that dtype, then adds. The mixes
normalise a float32 copy of the flattened streams and project it with a float32 GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.ops.norm_rope.reference import rms_normalize_reference
from dsinfer.ops.registry import REFERENCE, register


@register("hc_collapse", REFERENCE)
def hc_collapse_reference(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Weighted sum of the streams [..., n, D] with ``pre`` [..., n]: the single input a block sees, [..., D]."""
    return (pre.unsqueeze(-1) * streams).sum(dim=-2).to(streams.dtype)


@register("hc_expand", REFERENCE)
def hc_expand_reference(
    block_output: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams [..., n, D]: ``post`` [..., n] spreads the block output [..., D], ``comb`` [..., n, n]
    (applied transposed: ``out_i = post_i * y + sum_j comb_ji * stream_j``) mixes the old streams."""
    dtype = streams.dtype
    spread = post.to(dtype).unsqueeze(-1) * block_output.unsqueeze(-2)
    return spread + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


@register("hc_mixes", REFERENCE)
def hc_mixes_reference(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """The raw mHC weights [..., M] float32 of the streams [..., n, D]: the RMS-normalised flattened streams
    (no learned weight) projected by ``fn`` [M, n * D]; the layer turns them into ``pre``, ``post`` and ``comb``."""
    flat = rms_normalize_reference(streams.flatten(-2).float(), norm_eps)
    return F.linear(flat, fn.float())
