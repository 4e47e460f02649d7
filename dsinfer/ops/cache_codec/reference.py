"""The truth for V4.1's cache codecs: rows on a block-scaled FP8 / FP4 grid <-> codes plus one scale per block.

``element`` is ``"e4m3"`` (one float8 code per channel) or ``"e2m1"`` (two 4-bit codes per byte, channel ``2j`` in
the low nibble of byte ``j``); ``scale`` is ``"ue8m0"`` (a power-of-two exponent byte) or ``"e4m3"`` (a float8
scale). Why decoding gives back the fake quantizer's rounded rows bit for bit is argued in
:mod:`dsinfer.kv.codecs`, which describes the three formats the cache stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.fake_quant import e2m1_values, fp4_block_codes, fp4_block_scale, fp8_block_codes
from dsinfer.ops.quant import dequantize_fp4, device_constant, pack_e2m1_codes
from dsinfer.ops.registry import REFERENCE, register

# Every nonzero e2m1 magnitude but the largest (the fake quantizer's rule already tries amax / 6).
_SMALLER_E2M1_MAGNITUDES = (4.0, 3.0, 2.0, 1.5, 1.0, 0.5)


@register("cache_encode", REFERENCE)
def cache_encode_reference(
    values: torch.Tensor, element: str, block: int, scale: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[..., channels]`` (whole blocks) -> codes ``[..., code_width]`` and scales ``[..., channels / block]``."""
    blocks = values.float().unflatten(-1, (-1, block))
    if element == "e4m3":
        codes, scales = fp8_block_codes(blocks)
        return codes.flatten(-2), _scale_bytes(scales)
    if scale == "ue8m0":
        scales = fp4_block_scale(blocks.abs().amax(-1), e4m3_scales=False)
        codes = fp4_block_codes(blocks, scales)
    else:
        codes, scales = _lossless_e4m3_scaled_codes(blocks)
    packed = pack_e2m1_codes(codes.flatten(-2), validate=False).view(torch.uint8)  # codes are in range
    return packed, scales.to(torch.float8_e4m3fn) if scale == "e4m3" else _scale_bytes(scales)


@register("cache_decode", REFERENCE)
def cache_decode_reference(
    codes: torch.Tensor, scales: torch.Tensor, element: str, block: int, scale: str, dtype: torch.dtype
) -> torch.Tensor:
    """Codes and scales from :func:`cache_encode_reference` -> rows ``[..., channels]`` in ``dtype``."""
    factors = scales.view(torch.float8_e8m0fnu) if scale == "ue8m0" else scales
    if element == "e2m1":
        return dequantize_fp4(codes, factors.float(), block, dtype)
    values = codes.float().unflatten(-1, (-1, block)) * factors.float().unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales -> their ue8m0 exponent bytes (exact: ``2**-127`` .. ``2**127``)."""
    return scale.to(torch.float8_e8m0fnu).view(torch.uint8)


def _lossless_e4m3_scaled_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e2m1 codes and e4m3 scales (float32) of ``blocks [..., n, block]``: exact for rows on the grid.

    Candidates per block: the fake quantizer's scale, then ``amax / m`` for each smaller e2m1 magnitude; the
    first that is a positive e4m3 value and reproduces every element wins, the rule's scale when none does.
    """
    amax = blocks.abs().amax(-1, keepdim=True)
    magnitudes = device_constant(_SMALLER_E2M1_MAGNITUDES, blocks.device)
    rule = fp4_block_scale(amax, e4m3_scales=True)
    candidates = torch.cat([rule, amax / magnitudes], dim=-1)  # [..., n, 7]
    usable = (candidates > 0) & (candidates.to(torch.float8_e4m3fn).float() == candidates)
    tried = blocks.unsqueeze(-2)  # [..., n, 1, block]
    codes = fp4_block_codes(tried, candidates)  # [..., n, 7, block]
    exact = (e2m1_values(codes) * candidates.unsqueeze(-1) == tried).all(-1) & usable
    choice = exact.to(torch.uint8).argmax(-1, keepdim=True)  # the first exact candidate; 0 (the rule) if none
    chosen = candidates.gather(-1, choice).squeeze(-1)
    codes = codes.gather(-2, choice.unsqueeze(-1).expand(*choice.shape, blocks.shape[-1])).squeeze(-2)
    return codes, chosen


@dataclass(frozen=True)
class CacheStoreInputs:
    """Rows ``values`` [R, channels] and where they go in a cache pool (see :func:`cache_store_reference`)."""

    values: torch.Tensor
    data: torch.Tensor
    scales: torch.Tensor | None
    first: torch.Tensor
    second: torch.Tensor
    modulus: int | None
    element: str | None
    block: int
    scale: str | None


@register("cache_store", REFERENCE)
def cache_store_reference(inputs: CacheStoreInputs) -> None:
    """Store rows ``values`` [R, channels] at rows ``(first[r], second[r] % modulus)`` of a pool ``data``
    [N0, N1, width]: as they are (cast to the pool's dtype) when ``scales`` is None, else encoded (the format
    ``element`` / ``block`` / ``scale``), codes into ``data`` and scale bytes into ``scales`` [N0, N1, blocks].
    ``modulus`` None: ``second`` as it is. One op for what a cache write was: encode, index, two scatters."""
    values, data, scales, second, modulus = inputs.values, inputs.data, inputs.scales, inputs.second, inputs.modulus
    if values.numel() == 0:  # nothing to write (and no blocks to encode)
        return
    index = (inputs.first, second if modulus is None else second % modulus)
    if scales is None:
        data[index] = values.to(data.dtype)
        return
    codes, row_scales = cache_encode_reference(values, inputs.element, inputs.block, inputs.scale)
    data.view(torch.uint8)[index] = codes.view(torch.uint8)
    scales.view(torch.uint8)[index] = row_scales.view(torch.uint8)
