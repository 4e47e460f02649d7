"""The truth for mHC's stream collapse, expand and weight inputs: the torch expressions the models were validated
with.

Their dtype behaviour is part of the contract (the Triton backend is tested against it): the collapse multiplies
in the weights' float32 and rounds once to the streams' dtype; the expand casts ``post`` and ``comb`` to the
streams' dtype first, rounds the spread product and the mixing matmul each to that dtype, then adds. The mixes
normalise a float32 copy of the flattened streams and project it with a float32 GEMM; the weights turn the mixes
into ``pre``, ``post`` and ``comb`` in float32, one torch operation after the other. A site's input
(``hc_site_input``) is those three, collapsing with the site's own ``pre`` or a carried mix, in two halves
(:mod:`dsinfer.ops.mhc.site_parts`). V4's head (``hc_head``) is the mixes and the collapse with a ``pre`` of
its own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsinfer.ops.mhc.site_parts import SiteParts, composed_parts
from dsinfer.ops.norm_rope.reference import rms_normalize_reference
from dsinfer.ops.registry import REFERENCE, register
from dsinfer.ops.sinkhorn.reference import sinkhorn_reference


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


def streams_of_mixes(width: int) -> int:
    """``n`` from the mixes' width ``2n + n*n`` (that is ``(n + 1)**2 - 1``); a width of no such form is an error."""
    n = round((width + 1) ** 0.5) - 1
    if n < 1 or 2 * n + n * n != width:
        raise ValueError(f"mHC mixes have 2n + n*n values per token, got {width}")
    return n


@register("hc_weights", REFERENCE)
def hc_weights_reference(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iterations: int, hc_eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pre`` [..., n], ``post`` [..., n] and ``comb`` [..., n, n] (float32) from the raw mixes [..., 2n + n*n]:
    each part scaled by its ``scale`` entry plus its ``base`` slice; ``pre`` a sigmoid plus ``hc_eps``, ``post``
    twice a sigmoid, ``comb`` a row softmax plus ``hc_eps`` projected by Sinkhorn-Knopp."""
    n = streams_of_mixes(mixes.shape[-1])
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb_logits = comb_w.view(*comb_w.shape[:-1], n, n) * scale[2] + comb_b.view(n, n)
    comb = sinkhorn_reference(torch.softmax(comb_logits, dim=-1) + hc_eps, iterations, hc_eps)
    return pre, post, comb


def head_pre(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float) -> torch.Tensor:
    """The head's collapse weights [..., n] (float32) from its raw mixes [..., n]: a site's ``pre`` formula, with
    the head's one ``scale`` entry and ``n`` biases."""
    return torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps


@register("hc_head", REFERENCE)
def hc_head_reference(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """V4's ``hc_head``: the streams [..., n, D] collapsed into the final hidden state [..., D] (streams' dtype)
    with weights from their own mixes (``fn`` [n, n * D], ``base`` [n], ``scale`` [1]): the mixes and collapse
    references around :func:`head_pre`."""
    pre = head_pre(hc_mixes_reference(streams, fn, norm_eps), base, scale, hc_eps)
    return hc_collapse_reference(streams, pre)


@dataclass(frozen=True)
class HcSiteInputs:
    """One mHC site's input streams [..., n, D] and what its weights are made with: the mixes' ``fn``
    [2n + n*n, n * D] and ``norm_eps``, the ``base`` [2n + n*n] and ``scale`` [3] of the pre, post and comb parts,
    Sinkhorn's ``iterations`` and ``hc_eps``; ``carried_mix`` [..., n] float32 where the streams collapse with
    another site's ``pre`` (V4.1), else None."""

    streams: torch.Tensor
    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor
    iterations: int
    hc_eps: float
    norm_eps: float
    carried_mix: torch.Tensor | None = None


@register("hc_site_input", REFERENCE)
def hc_site_input_reference(inputs: HcSiteInputs) -> SiteParts:
    """One mHC site from its input streams, as :class:`~dsinfer.ops.mhc.site_parts.SiteParts`: the block input
    [..., D] (streams' dtype) and the site's float32 ``pre`` [..., n], ``post`` [..., n] and ``comb`` [..., n, n].
    The streams collapse with ``pre``, or with ``carried_mix`` where given (V4.1 collapses a site with the previous
    site's ``pre``). Exactly the mixes, weights and collapse references composed (the mixes now, and the weights
    too where the collapse reads ``pre``; the rest when asked), so a model on it computes what it did before the
    op."""
    mixes = hc_mixes_reference(inputs.streams, inputs.fn, inputs.norm_eps)
    sinkhorn = (inputs.base, inputs.scale, inputs.iterations, inputs.hc_eps)
    weights = functools.partial(hc_weights_reference, mixes, *sinkhorn)
    return composed_parts(inputs.streams, inputs.carried_mix, weights, hc_collapse_reference)
