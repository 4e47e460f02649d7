"""A whole mHC site input (``hc_site_input``) at decode in three launches instead of four: on the block's path
the mixes and the collapse (V4), or the collapse alone (V4.1, which collapses with a carried mix).

Each site turns its input streams [T, n, D] into the block's input: the mixes (``hc_mixes``), the weights
``pre``, ``post`` and Sinkhorn's ``comb`` (``hc_weights``), and the collapse with ``pre`` or, in V4.1, the previous
site's ``pre`` (``hc_collapse``). At decode each of those moves a few KiB and the launches are the cost: the
mixes split the n*D columns over programs and add the partial sums in a second kernel, so a site ran four
kernels back to back, eight sites a step.

When the mixes' plan splits the columns (few tokens: decode, small batches) this backend launches the mixes
kernel for the partial sums, then one kernel that adds them and does the rest. Its grid is (token blocks,
1 + column blocks) with two kinds of program, launched as two grids: the collapse's (the block input, on the
block's path) and column 0's (the weights, which only the expand after the block reads, so they can run on
another stream beside the block: :mod:`dsinfer.ops.mhc.site_parts`). So the block does not wait behind
Sinkhorn's twenty serial rounds:

* column 0 adds the token block's partials, scales them into the mixes, computes ``pre``, ``post`` and ``comb``
  with the same jit functions as ``hc_weights``' kernel and stores them;
* every other program collapses one block of columns: it adds the partials of ``pre``'s n mixes only (about
  a kilobyte from L2 at one token) and computes ``pre`` with the same function and inputs as column 0 (so the
  collapse uses the very ``pre`` that is returned), or reads the carried mix, and sums the n stream rows as
  ``hc_collapse``'s kernel does.

The partial sums are read once per program rather than once in all, which is why a program takes at most
``MAX_PARTIALS`` (token, split) rows: the column split is finest at one token (64 splits at V4's width), where a
program takes one token. Without a split (a prefill's token blocks fill the GPU) this backend runs the three
existing backends in sequence: their launches are not the cost there.

Numerics: the whole kernel compiles without fused multiply-adds, as ``hc_weights``' does (the weights must round
``w * scale`` and ``+ bias`` separately, like the reference). The collapse therefore rounds each float32
product before adding it, as the reference does (the collapse kernel may fuse them), and rounds the sum once to
the streams' dtype. The partials are added by one reduction per token, not necessarily in the order of the
mixes' finishing kernel, so ``pre``, ``post`` and ``comb`` equal the reference's within float32 rounding and the block
input within one unit in its last place (tests/ops/test_mhc_site.py).
"""

from __future__ import annotations

import functools
import math

import torch

from dsinfer.ops.mhc import mixes_triton
from dsinfer.ops.mhc.mixes_triton import hc_mixes_triton, launch_mixes, mixes_block, plan_for
from dsinfer.ops.mhc.reference import HcSiteInputs, hc_site_input_reference
from dsinfer.ops.mhc.site_parts import SiteParts, composed_parts
from dsinfer.ops.mhc.triton import DTYPES, hc_collapse_triton
from dsinfer.ops.mhc.weights_triton import hc_weights_triton
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

if triton is not None:
    from dsinfer.ops.mhc.weights_triton import _post_comb_weights, _pre_weight

# One warp per program, as hc_weights' kernel runs (its n x n reductions and Sinkhorn rounds stay in the warp).
# The sizes follow the separate kernels' H200 tuning. On the H200 the fused kernel takes 6.2 us a site in the V4
# slice's decode graph, against 5.4 us for the three kernels it replaces; the launches it saves pay that back
# (docs/perf.md, pass 9). Compiled for sm_90 they take at most 168 registers a thread, without spills.
NUM_WARPS = 1
MAX_TOKENS = 8  # tokens per program, as hc_weights' kernel takes
MAX_PARTIALS = 64  # (token, split) rows per program: column 0 holds [rows, n, n] comb partials, 32 values a thread
COLLAPSE_ELEMENTS = 512  # tokens x columns a collapse program sums (16 values a thread per stream row)
MIN_COLUMNS = 64  # the narrowest column block: 128-byte rows of bf16


if triton is not None:

    @triton.jit
    def _rms_scale(partial_squares, part, part_ok, columns, eps):
        """Each token's ``rsqrt(mean(x^2) + eps)`` from its partial sums of squares ([tokens, splits] rows)."""
        squares = tl.load(partial_squares + part, mask=part_ok, other=0.0)
        return 1.0 / tl.sqrt_rn(tl.sum(squares, axis=1) / columns + eps)

    @triton.jit
    def _mixes_slice(partial_dots, part, part_ok, first, rms, N: tl.constexpr, BLOCK_M: tl.constexpr):
        """Mixes ``first .. first + N`` of each token [tokens, N]: the partial dots added, then scaled."""
        i = tl.arange(0, N)
        offsets = part[:, :, None] * BLOCK_M + first + i[None, None, :]
        dots = tl.load(partial_dots + offsets, mask=part_ok[:, :, None], other=0.0)
        return tl.sum(dots, axis=1) * rms[:, None]

    @triton.jit
    def _site_kernel(
        partial_dots,
        partial_squares,
        base,
        scale,
        src,
        carried,
        dst,
        pre_out,
        post_out,
        comb_out,
        tokens,
        columns,
        D,
        norm_eps,
        hc_eps,
        N: tl.constexpr,
        ITERATIONS: tl.constexpr,
        SPLIT: tl.constexpr,
        SPLIT_P2: tl.constexpr,
        BLOCK_M: tl.constexpr,
        CARRIED: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        COLLAPSE_ONLY: tl.constexpr,  # the launch's programs are the collapse's column blocks only (no column 0)
    ):
        token = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # T * n * D may pass 2**31
        ok = token < tokens
        split = tl.arange(0, SPLIT_P2)
        part = split.to(tl.int64)[None, :] * tokens + token[:, None]  # [BLOCK_T, SPLIT_P2] rows of the partials
        part_ok = ok[:, None] & (split < SPLIT)[None, :]
        i = tl.arange(0, N)
        role = tl.program_id(1)
        if COLLAPSE_ONLY:
            role += 1
        if role == 0:  # the weights
            rms = _rms_scale(partial_squares, part, part_ok, columns, norm_eps)
            pre = _pre_weight(_mixes_slice(partial_dots, part, part_ok, 0, rms, N, BLOCK_M), base, scale, hc_eps, N)
            post = _mixes_slice(partial_dots, part, part_ok, N, rms, N, BLOCK_M)
            pair = i[:, None] * N + i[None, :]  # [N, N] offsets of the matrix
            offsets = part[:, :, None, None] * BLOCK_M + 2 * N + pair[None, None, :, :]
            dots = tl.load(partial_dots + offsets, mask=part_ok[:, :, None, None], other=0.0)
            logits = tl.sum(dots, axis=1) * rms[:, None, None]
            post, comb = _post_comb_weights(post, logits, base, scale, hc_eps, ITERATIONS, N)
            out_row = token[:, None] * N + i[None, :]
            tl.store(pre_out + out_row, pre, mask=ok[:, None])
            tl.store(post_out + out_row, post, mask=ok[:, None])
            tl.store(comb_out + token[:, None, None] * (N * N) + pair[None, :, :], comb, mask=ok[:, None, None])
        else:  # one block of columns of the collapse
            if CARRIED:
                mix = tl.load(carried + token[:, None] * N + i[None, :], mask=ok[:, None], other=0.0)
            else:
                rms = _rms_scale(partial_squares, part, part_ok, columns, norm_eps)
                mix = _pre_weight(_mixes_slice(partial_dots, part, part_ok, 0, rms, N, BLOCK_M), base, scale, hc_eps, N)
            column = (role - 1) * BLOCK_D + tl.arange(0, BLOCK_D)
            mask = ok[:, None] & (column < D)[None, :]
            acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
            for j in tl.static_range(N):
                weight = tl.sum(tl.where(i[None, :] == j, mix, 0.0), axis=1)  # column j, exactly (plus zeros)
                row = tl.load(src + (token * N + j)[:, None] * D + column[None, :], mask=mask, other=0.0)
                acc += weight[:, None] * row.to(tl.float32)
            tl.store(dst + token[:, None] * D + column[None, :], acc.to(dst.dtype.element_ty), mask=mask)


def _serves(inputs: HcSiteInputs) -> bool:
    """What the three backends together take: [..., n, D] streams of a float dtype with n a power of two (2 or 4:
    the mixes take at most ``MAX_M`` = 64 of 2n + n*n), an [2n + n*n, n * D] ``fn``, a matching ``base``, three
    ``scale`` entries, at least one Sinkhorn iteration and a float32 [..., n] carried mix if any."""
    streams, fn, base, scale, carried_mix = inputs.streams, inputs.fn, inputs.base, inputs.scale, inputs.carried_mix
    if not mixes_triton._serves(streams, fn) or streams.dtype not in DTYPES or inputs.iterations < 1:
        return False
    n = streams.shape[-2]
    width = 2 * n + n * n
    if n < 2 or n & (n - 1) or fn.shape[0] != width or base.numel() != width or scale.numel() < 3:
        return False
    if not (base.is_floating_point() and scale.is_floating_point()):
        return False
    return carried_mix is None or (carried_mix.dtype == torch.float32 and carried_mix.shape == streams.shape[:-1])


def collapse_blocks(tokens: int, width: int, split: int) -> tuple[int, int]:
    """Tokens and collapse columns per program: at most MAX_TOKENS tokens and MAX_PARTIALS partial rows, and
    COLLAPSE_ELEMENTS values per stream row block (at least MIN_COLUMNS columns, at most the width)."""
    block_t = min(MAX_TOKENS, max(1, MAX_PARTIALS // triton.next_power_of_2(split)), triton.next_power_of_2(tokens))
    block_d = min(triton.next_power_of_2(width), max(MIN_COLUMNS, COLLAPSE_ELEMENTS // block_t))
    return block_t, block_d


@register("hc_site_input", "triton", devices=("cuda",), available=triton_available, priority=10)
def hc_site_input_triton(inputs: HcSiteInputs) -> SiteParts:
    """Same contract as the reference; what the kernels do not take goes to it. With a column split the collapse
    is the site kernel's column blocks, the weights its column 0, each its own launch of the same kernel, when
    :class:`~dsinfer.ops.mhc.site_parts.SiteParts` asks for it (the collapse programs compute ``pre`` again rather
    than read column 0's). The mixes kernel runs now when the collapse reads them (its own ``pre``); a collapse
    with a carried mix (V4.1) reads none, so the mixes run with the weights, off the block's path too. Without a
    column split the weights run now where the collapse reads their ``pre``."""
    if not _serves(inputs):
        return hc_site_input_reference(inputs)
    streams, fn = inputs.streams, inputs.fn
    tokens = math.prod(streams.shape[:-2])
    plan = plan_for(streams, fn) if tokens else None
    if plan is None or plan[1] == 1:  # no column split: the three backends, one launch each
        mixes = hc_mixes_triton(streams, fn, inputs.norm_eps)
        sinkhorn = (inputs.base, inputs.scale, inputs.iterations, inputs.hc_eps)
        weights = functools.partial(hc_weights_triton, mixes, *sinkhorn)
        return composed_parts(streams, inputs.carried_mix, weights, hc_collapse_triton)
    site = _SplitSite(inputs, plan)
    return SiteParts(lambda: site.launch(collapse=True), lambda: site.launch(collapse=False))


class _SplitSite:
    """A site whose mixes split the columns: the mixes kernel's partial sums (launched at construction, or with
    the weights when the collapse takes a carried mix), the outputs, and the site kernel's launch over either half
    of its grid."""

    def __init__(self, inputs: HcSiteInputs, plan) -> None:
        streams, carried_mix = inputs.streams, inputs.carried_mix
        self.lead, (self.n, self.width) = streams.shape[:-2], streams.shape[-2:]
        tokens, n, device = math.prod(self.lead), self.n, streams.device
        self.flat = streams.contiguous().view(tokens, n * self.width)
        self.fn, self.plan, self.partials = inputs.fn.contiguous(), plan, None
        self.base, self.scale = inputs.base.float().contiguous(), inputs.scale.float().contiguous()
        self.collapsed = torch.empty(tokens, self.width, dtype=streams.dtype, device=device)
        self.pre = torch.empty(tokens, n, dtype=torch.float32, device=device)
        self.post = torch.empty(tokens, n, dtype=torch.float32, device=device)
        self.comb = torch.empty(tokens, n, n, dtype=torch.float32, device=device)
        self.carried = None if carried_mix is None else carried_mix.contiguous().view(tokens, n)
        self.iterations, self.hc_eps, self.norm_eps, self.split = (
            inputs.iterations,
            inputs.hc_eps,
            inputs.norm_eps,
            plan[1],
        )
        if self.carried is None:  # the collapse computes pre from the mixes' partial sums
            self.mixes()

    def mixes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixes kernel's partial dots and squares, launched on first use."""
        if self.partials is None:
            self.partials = launch_mixes(self.flat, self.fn, None, self.norm_eps, self.plan)
        return self.partials

    def launch(self, collapse: bool):
        """The collapse's column blocks (the block input) or column 0 (``pre``, ``post``, ``comb``)."""
        tokens, n, width = self.flat.shape[0], self.n, self.width
        block_t, block_d = collapse_blocks(tokens, width, self.split)
        grid = (triton.cdiv(tokens, block_t), triton.cdiv(width, block_d) if collapse else 1)
        carried = self.pre if self.carried is None else self.carried  # pre: not read
        if collapse and self.carried is not None:  # no partial sums read: any float32 pointers serve
            dots, squares = self.pre, self.pre
        else:
            dots, squares = self.mixes()
        _site_kernel[grid](
            dots, squares, self.base, self.scale, self.flat, carried, self.collapsed, self.pre, self.post,
            self.comb, tokens, n * width, width, float(self.norm_eps), float(self.hc_eps), N=n,
            ITERATIONS=self.iterations, SPLIT=self.split, SPLIT_P2=triton.next_power_of_2(self.split),
            BLOCK_M=mixes_block(self.fn.shape[0]), CARRIED=self.carried is not None, BLOCK_T=block_t, BLOCK_D=block_d,
            COLLAPSE_ONLY=collapse, enable_fp_fusion=False, num_warps=NUM_WARPS,
        )  # fmt: skip
        lead = self.lead
        if collapse:
            return self.collapsed.view(*lead, width)
        return self.pre.view(*lead, n), self.post.view(*lead, n), self.comb.view(*lead, n, n)
