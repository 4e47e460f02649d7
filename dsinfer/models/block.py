"""Transformer blocks on ``hc_mult`` residual streams: the mHC site step both variants share, and V4's block."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dsinfer.config import ModelConfig, ModelConfigBase
from dsinfer.kv.batch import PackedBatch
from dsinfer.layers.attention import Attention
from dsinfer.layers.mhc import expand_streams, site_input
from dsinfer.layers.moe import MoE
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.op_binding import reference_ops
from dsinfer.ops.mhc import HcSiteInputs
from dsinfer.ops.mhc.site_parts import SiteParts
from dsinfer.ops.registry import OpTable
from dsinfer.ops.side_stream import beside


def hc_parameters(config: ModelConfigBase) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """(fn, base, scale) of one hyper-connection site: pre (n), post (n) and comb (n * n) weights."""
    n = config.hc_mult
    width = (2 + n) * n
    return (
        nn.Parameter(torch.zeros(width, n * config.hidden_size, dtype=torch.float32)),
        nn.Parameter(torch.zeros(width, dtype=torch.float32)),
        nn.Parameter(torch.ones(3, dtype=torch.float32)),
    )


class HyperConnectedBlock(nn.Module):
    """What every block of both variants shares: an attention site and an MoE site on ``hc_mult`` streams.

    Each site computes (pre, post, comb) from its input streams and collapses them into the block's input in
    one op (:func:`site_input`), whose weights run beside the block at decode on CUDA, then spreads the output
    back (:func:`expand_streams`), in :meth:`run_site`. V4 collapses each site with its own ``pre``; V4.1 staggers
    them: a site collapses with the *previous* site's ``pre``. Subclasses set ``attn`` and ``ffn`` through
    :meth:`_build_sites` and run their sites top to bottom in ``forward``.
    """

    def _build_sites(self, config, attn: nn.Module, ffn: nn.Module) -> None:
        self.config = config
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = attn
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn = ffn
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = hc_parameters(config)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = hc_parameters(config)
        self.ops: OpTable = reference_ops()  # the model binds its table when it is built

    def site_input(self, streams: torch.Tensor, site: str, mix: torch.Tensor | None) -> SiteParts:
        """The block input and (pre, post, comb) of site ``attn`` or ``ffn`` from its input streams, as two halves;
        the streams collapse with ``mix`` where given, else with the site's own ``pre``."""
        cfg = self.config
        fn, base, scale = (getattr(self, f"hc_{site}_{part}") for part in ("fn", "base", "scale"))
        inputs = HcSiteInputs(streams, fn, base, scale, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, mix)
        return site_input(inputs, self.ops)

    def run_site(
        self,
        streams: torch.Tensor,
        site: str,
        mix: torch.Tensor | None,
        block: Callable[[torch.Tensor], torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One site (``attn`` or ``ffn``): the new streams and the site's ``pre``. The streams collapse with ``mix``
        (None: the site's own ``pre``), go through the site's norm and ``block``, and spread back. The site's
        weights run :func:`beside` the collapse, the norm and the block, which never read them (at decode on CUDA:
        on the side stream, so the block does not wait for Sinkhorn); the expand after the join reads them."""
        parts = self.site_input(streams, site, mix)
        norm = self.attn_norm if site == "attn" else self.ffn_norm
        (pre, post, comb), output = beside(parts.weights, lambda: block(norm(parts.collapse())), streams)
        return expand_streams(output, streams, post, comb, self.ops), pre


class Block(HyperConnectedBlock):
    """One V4 transformer block: attention (window, CSA or HCA) and MoE (hash-routed or scored)."""

    def __init__(self, config: ModelConfig, layer_id: int, compress_ratio: int, hash_routed: bool) -> None:
        super().__init__()
        self.layer_id = layer_id
        self._build_sites(config, Attention(config, compress_ratio), MoE(config, hash_routed))

    def forward(
        self, streams: torch.Tensor, batch: PackedBatch, inv_freq: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """The attention site, then the MoE site; each collapses the streams with its own ``pre``."""
        streams, _ = self.run_site(streams, "attn", None, lambda x: self.attn(x, batch, inv_freq, self.layer_id))
        streams, _ = self.run_site(streams, "ffn", None, lambda x: self.ffn(x, input_ids))
        return streams
