"""DeepSeek-V4.1's trained-in activation quantization, simulated in the forward pass ("fake quantization").

V4.1 was trained seeing three activations rounded through low-precision formats, so inference must round
them the same way (the reference applies them in every run, quantized weights or not):

* **window KV** (the whole post-RoPE 512-d vector, RoPE tail included): FP8 e4m3 in blocks of 32 channels,
  power-of-two (ue8m0) scales ``2**ceil(log2(max(amax, 1e-4) * (1/448)))``;
* **compressed KV** (post-RoPE latents): FP4 e2m1 in blocks of 16, e4m3 scales
  ``e4m3(max(amax, 6 * 2**-9) / 6)`` (round to nearest even);
* **indexer queries and keys** (post-RoPE): FP4 e2m1 in blocks of 32, ue8m0 scales from
  ``max(amax, 6 * 2**-126) * (1/6)``.

The rounding follows Hugging Face ``modeling_deepseek_v41.py`` (``_fake_quant_fp8_block``,
``_fake_quant_fp4_block``, ``_pow2_ceil_scale``) to the bit: the power-of-two ceiling reads the IEEE-754
fields of ``amax * fl32(1/max)`` (a product with the rounded reciprocal, not a division), e2m1 rounds to
nearest with ties to the even code, and a last axis that is not a whole number of blocks passes through
unchanged, as in the reference. Every ``fake_quant_*`` function returns a new tensor in the input dtype.

The rounding is also available in halves, codes and scales (:func:`fp8_block_codes`, :func:`fp4_block_scale`,
:func:`fp4_block_codes`), which the cache's storage formats (:mod:`dsinfer.kv.codecs`) share.
"""

from __future__ import annotations

import torch

from dsinfer.ops.quant import E2M1_VALUES, FP4_MAX, FP8_MAX, device_constant, round_to_e2m1_codes
from dsinfer.ops.registry import REFERENCE, register, resolve

WINDOW_KV_BLOCK = 32
COMPRESSED_KV_BLOCK = 16
INDEX_BLOCK = 32
FP8_AMAX_FLOOR = 1e-4
FP4_UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """``2**ceil(log2(t))`` for positive float32 ``t`` from its bit pattern: exponent - 127, +1 if any mantissa bit.

    Subnormal inputs (exponent field 0) give ``2**-127`` or ``2**-126``, as the reference kernel does.
    """
    bits = t.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    return torch.exp2((exponent - 127 + (mantissa != 0).to(torch.int32)).to(torch.float32))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor | None:
    if x.shape[-1] % block:
        return None
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def fp8_block_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 rounding's two halves: e4m3 codes shaped like ``blocks`` and one ue8m0 scale per block (float32).

    ``blocks`` is float32 ``[..., n_blocks, block]``; the value each element stands for is ``code * scale``.
    Shared with the cache's storage format so both round by the one rule.
    """
    amax = blocks.abs().amax(-1).clamp_min(FP8_AMAX_FLOOR)
    scale = pow2_ceil(amax * (1.0 / FP8_MAX))
    codes = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def fp4_block_scale(amax: torch.Tensor, e4m3_scales: bool) -> torch.Tensor:
    """The FP4 scale (float32) of blocks whose largest magnitude is ``amax``: e4m3-rounded or a power of two."""
    if e4m3_scales:
        return (amax.clamp_min(FP4_E4M3_AMAX_FLOOR) / FP4_MAX).to(torch.float8_e4m3fn).float()
    return pow2_ceil(amax.clamp_min(FP4_UE8M0_AMAX_FLOOR) * (1.0 / FP4_MAX))


def fp4_block_codes(blocks: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (``uint8`` in [0, 15]) of float32 ``blocks [..., n, block]`` under ``scale [..., n]``.

    Ties go to the even code; magnitudes above 6 saturate.
    """
    return round_to_e2m1_codes((blocks / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """The float32 value of each 4-bit e2m1 code."""
    return device_constant(E2M1_VALUES, codes.device)[codes.long()]


@register("fake_quant_fp8", REFERENCE)
def fake_quant_fp8(x: torch.Tensor, block: int = WINDOW_KV_BLOCK) -> torch.Tensor:
    """Round ``x`` through FP8 e4m3 with one ue8m0 scale per ``block`` channels of the last axis."""
    blocks = _blocks(x, block)
    if blocks is None:
        return x
    codes, scale = fp8_block_codes(blocks)
    return (codes.float() * scale.unsqueeze(-1)).reshape(x.shape).to(x.dtype)


@register("fake_quant_fp4", REFERENCE)
def fake_quant_fp4(x: torch.Tensor, block: int, e4m3_scales: bool) -> torch.Tensor:
    """Round ``x`` through FP4 e2m1 with one scale per ``block`` channels (e4m3 or ue8m0 scales)."""
    blocks = _blocks(x, block)
    if blocks is None:
        return x
    scale = fp4_block_scale(blocks.abs().amax(-1), e4m3_scales)
    values = e2m1_values(fp4_block_codes(blocks, scale))
    return (values * scale.unsqueeze(-1)).reshape(x.shape).to(x.dtype)


def fake_quant_window_kv(x: torch.Tensor) -> torch.Tensor:
    """The window KV cache's FP8 rounding (blocks of 32, ue8m0 scales)."""
    return fake_quant_fp8(x, WINDOW_KV_BLOCK)


def fake_quant_compressed_kv(x: torch.Tensor) -> torch.Tensor:
    """The compressed KV cache's FP4 rounding (blocks of 16, e4m3 scales)."""
    return fake_quant_fp4(x, COMPRESSED_KV_BLOCK, e4m3_scales=True)


def fake_quant_index(x: torch.Tensor) -> torch.Tensor:
    """The indexer's FP4 rounding of its queries and keys (blocks of 32, ue8m0 scales)."""
    return fake_quant_fp4(x, INDEX_BLOCK, e4m3_scales=False)


class ActivationQuantizer:
    """Where the model applies its trained-in rounding: one call per quantization point.

    ``enabled=False`` makes every point the identity (for testing the continuous math). Each call names
    the layer and the positions (or compressed entry ids) of its rows, so a test can record and replay
    rounding decisions between two evaluation orders.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled

    @staticmethod
    def _ops(x: torch.Tensor):
        """The op table of ``x``'s device and dtype (chosen once per setting): the Triton kernels on CUDA."""
        return resolve(x.device, x.dtype)

    # each point's rounding as (format, block), the names the ``rope_and_round`` op takes
    POINT_ROUNDINGS = {
        "window_kv": ("fp8", WINDOW_KV_BLOCK),
        "compressed_kv": ("fp4_e4m3", COMPRESSED_KV_BLOCK),
        "index_keys": ("fp4_ue8m0", INDEX_BLOCK),
        "index_queries": ("fp4_ue8m0", INDEX_BLOCK),
    }

    def fusable_rounding(self, point: str) -> tuple[str | None, int] | None:
        """``point``'s rounding as (format, block) for an op that fuses it with the RoPE before it ((None, 0)
        while rounding is off), or None where this quantizer's class overrides the point: its own method must
        see every value (a test's replay, training's straight-through rounding)."""
        if getattr(type(self), point) is not getattr(ActivationQuantizer, point):
            return None
        return self.POINT_ROUNDINGS[point] if self.enabled else (None, 0)

    def window_kv(self, x: torch.Tensor, layer: object, positions: torch.Tensor) -> torch.Tensor:
        """x [T, head_dim] post-RoPE window keys (= values) at ``positions``."""
        return self._ops(x).fake_quant_fp8(x, WINDOW_KV_BLOCK) if self.enabled else x

    def compressed_kv(self, x: torch.Tensor, layer: object, entry_ids: torch.Tensor) -> torch.Tensor:
        """x [g, head_dim] post-RoPE compressed entries of one sequence (a decode step: one row per sequence,
        ``entry_ids`` -1 for the rows of unfinished windows, which go to the trash block)."""
        return self._ops(x).fake_quant_fp4(x, COMPRESSED_KV_BLOCK, True) if self.enabled else x

    def index_keys(self, x: torch.Tensor, layer: object, entry_ids: torch.Tensor) -> torch.Tensor:
        """x [g, index_head_dim] post-RoPE index keys of one sequence."""
        return self._ops(x).fake_quant_fp4(x, INDEX_BLOCK, False) if self.enabled else x

    def index_queries(self, x: torch.Tensor, layer: object, positions: torch.Tensor) -> torch.Tensor:
        """x [n, index_heads, index_head_dim] post-RoPE indexer queries of one sequence."""
        return self._ops(x).fake_quant_fp4(x, INDEX_BLOCK, False) if self.enabled else x
