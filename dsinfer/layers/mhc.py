"""Manifold-constrained hyper-connections (mHC): ``hc_mult`` residual streams instead of one.

Before each attention or MoE block the streams are collapsed into one input (weights ``pre``); after the
block its output is spread back over the streams (``post``) and added to a mix of the old streams
(``comb``, projected onto doubly-stochastic matrices by Sinkhorn-Knopp so the residual cannot blow up).
All weights come from a small projection of the normalised streams themselves.
"""

from __future__ import annotations

import torch

from dsinfer.ops.mhc import (
    HcSiteInputs,
    hc_collapse_reference,
    hc_expand_reference,
    hc_head_reference,
    hc_mixes_reference,
    hc_site_input_reference,
    hc_weights_reference,
)
from dsinfer.ops.mhc.site_parts import SiteParts
from dsinfer.ops.registry import OpTable


def hyper_connection_weights(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iterations: int,
    hc_eps: float,
    norm_eps: float,
    ops: OpTable | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From streams [T, n, D] compute ``pre`` [T, n], ``post`` [T, n] and ``comb`` [T, n, n], in fp32.

    ``ops`` is the model's op table (its ``hc_mixes`` and ``hc_weights`` backends: on CUDA the normalisation and
    projection in one pass over the streams, then every token's weights and Sinkhorn in one kernel); without one
    the torch reference runs."""
    mixes = (ops.hc_mixes if ops is not None else hc_mixes_reference)(streams, fn, norm_eps)
    weights = ops.hc_weights if ops is not None else hc_weights_reference
    return weights(mixes, base, scale, sinkhorn_iterations, hc_eps)


def site_input(inputs: HcSiteInputs, ops: OpTable | None = None) -> SiteParts:
    """One site's block input [T, D] and its ``pre``, ``post`` and ``comb`` from its input streams [T, n, D], as
    two halves (:class:`~dsinfer.ops.mhc.site_parts.SiteParts`: ``collapse()``, ``weights()``, or ``all()``):
    :func:`hyper_connection_weights`, and :func:`collapse_streams` with ``pre``, or with ``inputs.carried_mix``
    where given (V4.1 collapses with the previous site's ``pre``).

    ``ops`` is the model's op table (its ``hc_site_input`` backend: at decode on CUDA the mixes, then one launch
    for each half); without one the torch reference runs, the same functions composed."""
    return (ops.hc_site_input if ops is not None else hc_site_input_reference)(inputs)


def collapse_streams(streams: torch.Tensor, pre: torch.Tensor, ops: OpTable | None = None) -> torch.Tensor:
    """Weighted sum of the streams: the single input a block sees.

    ``ops`` is the model's op table (its ``hc_collapse`` backend: one kernel on CUDA); without one the torch
    reference runs."""
    collapse = ops.hc_collapse if ops is not None else hc_collapse_reference
    return collapse(streams, pre)


def expand_streams(
    block_output: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    ops: OpTable | None = None,
) -> torch.Tensor:
    """New streams: ``post`` spreads the block output, ``comb`` (applied transposed) mixes the old streams.

    ``ops`` as for :func:`collapse_streams` (its ``hc_expand`` backend)."""
    expand = ops.hc_expand if ops is not None else hc_expand_reference
    return expand(block_output, streams, post, comb)


def hyper_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    ops: OpTable | None = None,
) -> torch.Tensor:
    """Final collapse of the streams before the output norm (V4's ``hc_head``): the mixes of the streams give
    the collapse's weights. ``ops`` is the model's op table (its ``hc_head`` backend: at decode on CUDA the mixes
    and one collapse launch); without one the torch reference runs."""
    head = ops.hc_head if ops is not None else hc_head_reference
    return head(streams, fn, base, scale, hc_eps, norm_eps)
