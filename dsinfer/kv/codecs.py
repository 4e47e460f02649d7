"""Block-scaled storage of V4.1's rounded activations: codes plus one scale per block, lossless.

V4.1's fake quantizers (:mod:`dsinfer.ops.fake_quant`) leave every window KV vector, compressed KV entry
and index key on a block-scaled FP8 / FP4 grid, but in the model dtype. A :class:`CacheFormat` stores such
rows as what they are, one byte per code or per scale:

=================  ===================================  =====================================
rows               codes                                scales
=================  ===================================  =====================================
window KV          ``float8_e4m3fn``, one per channel   ``uint8`` ue8m0 exponent per 32
compressed KV      ``uint8``, two e2m1 per byte         ``float8_e4m3fn`` per 16
index keys         ``uint8``, two e2m1 per byte         ``uint8`` ue8m0 exponent per 32
=================  ===================================  =====================================

A ue8m0 byte ``b`` is the scale ``2**(b - 127)`` (torch's ``float8_e8m0fnu`` bits); packed e2m1 codes put
channel ``2j`` in the low nibble of byte ``j`` (:func:`~dsinfer.ops.quant.pack_e2m1_codes`).

**Why decoding gives back the rounded values bit for bit** (fp32 and bf16; the grid values and their
products with the scales are exact in both). The encoder does not know the scale the fake quantizer used,
only its output ``y``, and picks a scale under which every element of the block is a code:

* ue8m0 scales: the fake quantizer's own rule applied to ``y``. Rounding maps its own output to itself: a
  block rounded under the power of two ``s`` has its largest code in ``[max/2, max]`` (or sits under the
  amax floor), so the rule re-derives ``s`` or a smaller power of two, and a code times a power of two
  that stays within ``max`` is a code again (``e4m3`` and e2m1 magnitudes are a few leading bits).
* e4m3 scales (compressed KV): the rule is *not* idempotent where the scale is an e4m3 subnormal (scale
  ``2**-8`` and largest code 4 re-derive ``2**-9``, under which the 4 would need an 8). The encoder tries
  the rule's scale first, then ``amax / m`` for every e2m1 magnitude ``m``, and keeps the first candidate
  that is an e4m3 value and reproduces the whole block; ``amax = m_max * s`` makes the original scale
  ``s`` one of them.

Rows that are not on the grid (fake quantization off) are rounded by the fake quantizer's rule instead, so
the cache refuses that combination rather than silently changing the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.fake_quant import (
    COMPRESSED_KV_BLOCK,
    INDEX_BLOCK,
    WINDOW_KV_BLOCK,
    e2m1_values,
    fp4_block_codes,
    fp4_block_scale,
    fp8_block_codes,
)
from dsinfer.ops.quant import dequantize_fp4, pack_e2m1_codes

ELEMENTS = ("e4m3", "e2m1")
SCALES = ("ue8m0", "e4m3")

# Every nonzero e2m1 magnitude but the largest (the fake quantizer's rule already tries amax / 6).
_SMALLER_E2M1_MAGNITUDES = (4.0, 3.0, 2.0, 1.5, 1.0, 0.5)


@dataclass(frozen=True)
class CacheFormat:
    """One block-scaled storage format: ``element`` codes, one ``scale`` per ``block`` channels of the last axis."""

    name: str  # the rows it stores, for error messages
    element: str  # "e4m3": one float8 code per channel; "e2m1": two 4-bit codes per byte
    block: int
    scale: str  # "ue8m0": a power-of-two exponent byte; "e4m3": a float8 scale

    def __post_init__(self) -> None:
        if self.element not in ELEMENTS or self.scale not in SCALES:
            raise ValueError(f"{self.name}: element must be one of {ELEMENTS} and scale one of {SCALES}")
        if self.block <= 0 or self.block % 2:
            raise ValueError(f"{self.name}: block must be a positive even number of channels, got {self.block}")

    # ---- layout --------------------------------------------------------------------------------------
    @property
    def code_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.element == "e4m3" else torch.uint8

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.uint8 if self.scale == "ue8m0" else torch.float8_e4m3fn

    def check_channels(self, channels: int) -> None:
        """Refuse a row width the fake quantizer would pass through unrounded (not whole blocks)."""
        if channels <= 0 or channels % self.block:
            raise ValueError(
                f"{self.name}: {channels} channels are not a whole number of {self.block}-channel blocks, so the "
                "trained-in rounding leaves them unrounded and they have no block-scaled encoding"
            )

    def code_width(self, channels: int) -> int:
        """Bytes of codes per row of ``channels``."""
        return channels if self.element == "e4m3" else channels // 2

    def scale_width(self, channels: int) -> int:
        """Scales (one byte each) per row of ``channels``."""
        return channels // self.block

    def row_bytes(self, channels: int) -> int:
        return self.code_width(channels) + self.scale_width(channels)

    # ---- encode / decode -----------------------------------------------------------------------------
    def encode(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[..., channels]`` -> codes ``[..., code_width]`` and scales ``[..., scale_width]``."""
        self.check_channels(values.shape[-1])
        blocks = values.float().unflatten(-1, (-1, self.block))
        if self.element == "e4m3":
            codes, scale = fp8_block_codes(blocks)
            return codes.flatten(-2), _scale_bytes(scale)
        if self.scale == "ue8m0":
            scale = fp4_block_scale(blocks.abs().amax(-1), e4m3_scales=False)
            codes = fp4_block_codes(blocks, scale)
        else:
            codes, scale = _lossless_e4m3_scaled_codes(blocks)
        packed = pack_e2m1_codes(codes.flatten(-2), validate=False).view(torch.uint8)  # codes are in range
        return packed, scale.to(torch.float8_e4m3fn) if self.scale == "e4m3" else _scale_bytes(scale)

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Codes and scales from :meth:`encode` -> rows ``[..., channels]`` in ``dtype``."""
        if codes.dtype != self.code_dtype or scales.dtype != self.scale_dtype:
            raise ValueError(
                f"{self.name}: expected {self.code_dtype} codes and {self.scale_dtype} scales, "
                f"got {codes.dtype} and {scales.dtype}"
            )
        scale = scales.view(torch.float8_e8m0fnu) if self.scale == "ue8m0" else scales
        if self.element == "e2m1":
            return dequantize_fp4(codes, scale.float(), self.block, dtype)
        values = codes.float().unflatten(-1, (-1, self.block)) * scale.float().unsqueeze(-1)
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
    magnitudes = torch.tensor(_SMALLER_E2M1_MAGNITUDES, dtype=torch.float32, device=blocks.device)
    rule = fp4_block_scale(amax, e4m3_scales=True)
    candidates = torch.cat([rule, amax / magnitudes], dim=-1)  # [..., n, 7]
    usable = (candidates > 0) & (candidates.to(torch.float8_e4m3fn).float() == candidates)
    tried = blocks.unsqueeze(-2)  # [..., n, 1, block]
    codes = fp4_block_codes(tried, candidates)  # [..., n, 7, block]
    exact = (e2m1_values(codes) * candidates.unsqueeze(-1) == tried).all(-1) & usable
    choice = exact.to(torch.uint8).argmax(-1, keepdim=True)  # the first exact candidate; 0 (the rule) if none
    scale = candidates.gather(-1, choice).squeeze(-1)
    codes = codes.gather(-2, choice.unsqueeze(-1).expand(*choice.shape, blocks.shape[-1])).squeeze(-2)
    return codes, scale


WINDOW_KV_FORMAT = CacheFormat("window KV", "e4m3", WINDOW_KV_BLOCK, "ue8m0")
"""The window rings: FP8 e4m3 per channel, a ue8m0 exponent per 32 channels."""

COMPRESSED_KV_FORMAT = CacheFormat("compressed KV", "e2m1", COMPRESSED_KV_BLOCK, "e4m3")
"""Compressed entries: FP4 e2m1, two per byte, an e4m3 scale per 16 channels."""

INDEX_KEY_FORMAT = CacheFormat("index keys", "e2m1", INDEX_BLOCK, "ue8m0")
"""Index keys: FP4 e2m1, two per byte, a ue8m0 exponent per 32 channels."""
