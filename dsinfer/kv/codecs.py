"""Block-scaled storage of V4.1's rounded activations: codes plus one scale per block, lossless.

The formats are described here; the arithmetic is the ``cache_encode`` / ``cache_decode`` ops
(:mod:`dsinfer.ops.cache_codec`), called through the op table the cache was built with (so a faster backend
registered beside the reference serves the cache too).

V4.1's fake quantizers (:mod:`dsinfer.ops.fake_quant`) leave every window KV vector, compressed KV entry
and index key on a block-scaled FP8 / FP4 grid, but in the model dtype. A :class:`CacheFormat` stores such
rows as what they are, one byte per code or per scale:

=================  ===================================  =====================================
rows               codes                                scales
=================  ===================================  =====================================
window KV          ``float8_e4m3fn``, one per channel   ``uint8`` ue8m0 exponent per 32
compressed KV      ``uint8``, two e2m1 per byte         ``float8_e4m3fn`` per 16
index keys         ``uint8``, two e2m1 per byte         ``uint8`` ue8m0 exponent per 32
index keys (FP8)   ``float8_e4m3fn``, one per channel   ``uint8`` ue8m0 exponent per 128
=================  ===================================  =====================================

The FP8 index keys are V4's indexer cache as the release keeps it (``--kv-cache-dtype fp8`` in vLLM's spelling;
``auto`` / ``bfloat16`` keep the model dtype): the keys are rounded to e4m3 under one power-of-two scale per
128 channels (the release's ``act_quant`` with ue8m0 scales, :func:`~dsinfer.ops.fake_quant.fp8_block_codes`), so
unlike the rows above they are not lossless for keys that were not rounded first; the release stores the scale as a
float32, here its exponent byte (the same value). ``index_scores_paged`` and ``indexer_topk_decode`` read either.

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

from dsinfer.ops.fake_quant import COMPRESSED_KV_BLOCK, INDEX_BLOCK, WINDOW_KV_BLOCK
from dsinfer.ops.registry import OpTable, resolve

ELEMENTS = ("e4m3", "e2m1")
SCALES = ("ue8m0", "e4m3")


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
    def encode(self, values: torch.Tensor, ops: OpTable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``[..., channels]`` -> codes ``[..., code_width]`` and scales ``[..., scale_width]``.

        ``ops``: the op table to encode with (None: the one chosen for the rows' device and dtype)."""
        self.check_channels(values.shape[-1])
        ops = ops if ops is not None else resolve(values.device, values.dtype)
        return ops.cache_encode(values, self.element, self.block, self.scale)

    def decode(
        self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, ops: OpTable | None = None
    ) -> torch.Tensor:
        """Codes and scales from :meth:`encode` -> rows ``[..., channels]`` in ``dtype``."""
        if codes.dtype != self.code_dtype or scales.dtype != self.scale_dtype:
            raise ValueError(
                f"{self.name}: expected {self.code_dtype} codes and {self.scale_dtype} scales, "
                f"got {codes.dtype} and {scales.dtype}"
            )
        ops = ops if ops is not None else resolve(codes.device, dtype)
        return ops.cache_decode(codes, scales, self.element, self.block, self.scale, dtype)


WINDOW_KV_FORMAT = CacheFormat("window KV", "e4m3", WINDOW_KV_BLOCK, "ue8m0")
"""The window rings: FP8 e4m3 per channel, a ue8m0 exponent per 32 channels."""

COMPRESSED_KV_FORMAT = CacheFormat("compressed KV", "e2m1", COMPRESSED_KV_BLOCK, "e4m3")
"""Compressed entries: FP4 e2m1, two per byte, an e4m3 scale per 16 channels."""

INDEX_KEY_FORMAT = CacheFormat("index keys", "e2m1", INDEX_BLOCK, "ue8m0")
"""Index keys: FP4 e2m1, two per byte, a ue8m0 exponent per 32 channels."""

INDEX_KEY_FP8_BLOCK = 128
INDEX_KEY_FP8_FORMAT = CacheFormat("index keys (FP8)", "e4m3", INDEX_KEY_FP8_BLOCK, "ue8m0")
"""V4's indexer keys in an FP8 cache: e4m3 per channel, a ue8m0 exponent per 128 channels (the release's layout)."""


def index_key_fp8_format(channels: int) -> CacheFormat:
    """The FP8 index-key format for keys of ``channels``: :data:`INDEX_KEY_FP8_FORMAT` where they are whole
    128-channel blocks (the release's 128-channel keys: one scale a key); a narrower key (a small test model's)
    takes one scale for the whole key, as the release's keys do."""
    if channels % INDEX_KEY_FP8_BLOCK == 0 or channels > INDEX_KEY_FP8_BLOCK:
        return INDEX_KEY_FP8_FORMAT
    return CacheFormat(INDEX_KEY_FP8_FORMAT.name, "e4m3", channels, "ue8m0")
