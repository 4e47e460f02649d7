"""The truth for a decode step's index scores over paged keys: the lightning indexer's scores (``index_scores``)
of each sequence's query against the keys of every slot of its block table.

``keys`` is the pool [blocks, per_block, d] in one of three forms (the index-key formats of :mod:`dsinfer.kv.codecs`):

* plain: the model dtype, ``key_scales`` None;
* FP8: ``float8_e4m3fn`` codes [blocks, per_block, d] with ``key_scales`` [blocks, per_block, d / block], ue8m0
  exponent bytes (``uint8``) or ``float32`` factors (the release's indexer cache: one scale per 128 channels);
* FP4: packed e2m1 codes ``uint8`` [blocks, per_block, d / 2] with ue8m0 ``key_scales`` [blocks, per_block, d / 32].

Slots past a sequence's ``visible`` entries score -inf, whatever their keys hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.cache_codec.reference import cache_decode_reference
from dsinfer.ops.index_scores.reference import index_scores_reference
from dsinfer.ops.registry import REFERENCE, register

SCALE_DTYPES = (torch.uint8, torch.float32)


def paged_key_form(keys: torch.Tensor, key_scales: torch.Tensor | None, head_dim: int) -> str:
    """ "plain", "fp8" or "fp4", after checking the pool's shapes against the query's ``head_dim`` (one clear error
    naming what does not fit)."""
    if key_scales is None:
        form, width = "plain", head_dim
    elif keys.dtype == torch.float8_e4m3fn:
        form, width = "fp8", head_dim
    elif keys.dtype == torch.uint8:
        form, width = "fp4", head_dim // 2
    else:
        raise ValueError(f"index keys with scales must be float8_e4m3fn (FP8) or uint8 (packed FP4), got {keys.dtype}")
    if keys.dim() != 3 or keys.shape[-1] != width:
        raise ValueError(f"{form} index keys must be [blocks, per_block, {width}] for {head_dim}-dim queries, "
                         f"got {tuple(keys.shape)}")  # fmt: skip
    if key_scales is not None:
        blocks = key_scales.shape[-1] if key_scales.dim() == 3 else 0
        if key_scales.shape[:2] != keys.shape[:2] or not blocks or head_dim % blocks:
            raise ValueError(f"index key scales must be [blocks, per_block, d / block] beside keys "
                             f"{tuple(keys.shape)}, got {tuple(key_scales.shape)}")  # fmt: skip
        if key_scales.dtype not in SCALE_DTYPES or (form == "fp4" and key_scales.dtype != torch.uint8):
            raise ValueError(f"{form} index key scales must be uint8 (ue8m0) or float32 (FP8 only), "
                             f"got {key_scales.dtype}")  # fmt: skip
    return form


def decode_paged_keys(
    keys: torch.Tensor, key_scales: torch.Tensor | None, block_tables: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """Every block-table slot's key [B, max_blocks * per_block, d]: plain keys as stored, coded ones in float32."""
    form = paged_key_form(keys, key_scales, head_dim)
    if form == "plain":
        return keys[block_tables].flatten(1, 2)
    block = head_dim // key_scales.shape[-1]
    scales = key_scales[block_tables]
    if form == "fp8":
        factors = scales.view(torch.float8_e8m0fnu) if scales.dtype == torch.uint8 else scales
        values = keys[block_tables].float().unflatten(-1, (-1, block)) * factors.float().unsqueeze(-1)
        return values.flatten(-2).flatten(1, 2)
    codes = keys[block_tables]
    return cache_decode_reference(codes, scales, "e2m1", block, "ue8m0", torch.float32).flatten(1, 2)


@dataclass(frozen=True)
class PagedIndexInputs:
    """A decode step's index queries and the paged index keys they score (``index_scores_paged``, and the
    indexer's choice ``indexer_topk_decode``, read the same ones).

    q [B, H, d]; head_weights [B, H] float32, already scaled; keys [blocks, per_block, d] in one of the forms above
    with its ``key_scales`` (None: plain); block_tables [B, max_blocks]; visible [B] entries each query may see.
    """

    q: torch.Tensor
    head_weights: torch.Tensor
    keys: torch.Tensor
    key_scales: torch.Tensor | None
    block_tables: torch.Tensor
    visible: torch.Tensor

    def gathered_keys(self) -> torch.Tensor:
        """Every block-table slot's key, decoded: [B, max_blocks * per_block, d]."""
        return decode_paged_keys(self.keys, self.key_scales, self.block_tables, self.q.shape[-1])


@register("index_scores_paged", REFERENCE)
def index_scores_paged_reference(inputs: PagedIndexInputs) -> torch.Tensor:
    """Scores [B, max_blocks * per_block] float32 (shapes: :class:`PagedIndexInputs`)."""
    return index_scores_reference(inputs.q, inputs.gathered_keys(), inputs.head_weights, inputs.visible)
