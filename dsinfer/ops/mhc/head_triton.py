"""V4's last collapse (``hc_head``) at decode in two launches: the mixes' partial sums, then the site kernel's
collapse programs.

The head collapses the streams [T, n, D] into the final hidden state with weights of their own: the n mixes of
the RMS-normalised streams (``fn`` [n, n * D]), scaled by the one ``scale`` entry, biased by ``base`` [n], a
sigmoid plus ``hc_eps``. That is a site's ``pre`` formula on a site's first n mixes, so when the mixes split the
columns (decode, small batches) the site kernel's collapse programs (:mod:`dsinfer.ops.mhc.site_triton`) serve
it as they are: each adds the partials of the n mixes, computes the weights and sums its block of the n stream
rows. The torch composition it replaces ran about fifteen kernels a step (the normalisation's passes, cuBLAS's
GEMV and its reduction, the weights' four element-wise kernels, the collapse's product, sum and cast).

Without a column split (a prefill's token blocks fill the GPU) the mixes and collapse backends run with the
weights computed between them by the reference's expression: there the launches are not the cost.

Numerics as the site kernel's collapse (tests/ops/test_mhc_head.py): the weights equal the reference's within
float32 rounding (the partials are added in another order than the reference's GEMM), the hidden state within
one unit in its last place of the collapse with those weights.
"""

from __future__ import annotations

import math

import torch

from dsinfer.ops.mhc import mixes_triton
from dsinfer.ops.mhc.mixes_triton import hc_mixes_triton, launch_mixes, mixes_block, plan_for
from dsinfer.ops.mhc.reference import hc_head_reference, head_pre
from dsinfer.ops.mhc.site_triton import NUM_WARPS, collapse_blocks
from dsinfer.ops.mhc.triton import DTYPES, hc_collapse_triton
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import triton, triton_available

if triton is not None:
    from dsinfer.ops.mhc.site_triton import _site_kernel


def _serves(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor) -> bool:
    """What the kernels take: [..., n, D] streams of a float dtype with n a power of two of at least 2, an
    [n, n * D] ``fn``, ``n`` float biases and at least one float ``scale`` entry."""
    if not mixes_triton._serves(streams, fn) or streams.dtype not in DTYPES:
        return False
    n = streams.shape[-2]
    if n < 2 or n & (n - 1) or fn.shape[0] != n or base.numel() != n or scale.numel() < 1:
        return False
    return base.is_floating_point() and scale.is_floating_point()


@register("hc_head", "triton", devices=("cuda",), available=triton_available, priority=10)
def hc_head_triton(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """Same contract as the reference; what the kernels do not take goes to it."""
    if not _serves(streams, fn, base, scale):
        return hc_head_reference(streams, fn, base, scale, hc_eps, norm_eps)
    lead, (n, width) = streams.shape[:-2], streams.shape[-2:]
    tokens = math.prod(lead)
    if not tokens:
        return streams.new_empty(*lead, width)
    plan = plan_for(streams, fn)
    if plan[1] == 1:  # no column split: the mixes and collapse backends, the weights between them as the reference
        return hc_collapse_triton(streams, head_pre(hc_mixes_triton(streams, fn, norm_eps), base, scale, hc_eps))
    flat = streams.contiguous().view(tokens, n * width)
    dots, squares = launch_mixes(flat, fn.contiguous(), None, norm_eps, plan)
    collapsed = torch.empty(tokens, width, dtype=streams.dtype, device=streams.device)
    split = plan[1]
    block_t, block_d = collapse_blocks(tokens, width, split)
    # Collapse programs only: the weights' branch (column 0, which would read a site's post and comb mixes and
    # write its outputs) never runs, so its output pointers are placeholders and one Sinkhorn round compiles.
    _site_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(width, block_d))](
        dots, squares, base.float().contiguous(), scale.float().contiguous(), flat, dots, collapsed, dots, dots,
        dots, tokens, n * width, width, float(norm_eps), float(hc_eps), N=n, ITERATIONS=1, SPLIT=split,
        SPLIT_P2=triton.next_power_of_2(split), BLOCK_M=mixes_block(n), CARRIED=False, BLOCK_T=block_t,
        BLOCK_D=block_d, COLLAPSE_ONLY=True, enable_fp_fusion=False, num_warps=NUM_WARPS,
    )  # fmt: skip
    return collapsed.view(*lead, width)
