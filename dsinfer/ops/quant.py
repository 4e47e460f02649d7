"""Block-scaled FP8 (e4m3) and FP4 (e2m1) weight formats of the DeepSeek-V4 checkpoints.

The official DeepSeek-V4-Flash checkpoint stores three kinds of quantised weight:

* **FP8 linear weights** (attention projections, shared experts, indexer ``wq_b``, MTP
  ``e_proj``/``h_proj``): a ``float8_e4m3fn`` tensor ``[out, in]`` plus a ``.scale`` tensor of
  shape ``[ceil(out/128), ceil(in/128)]``, one scale per 128x128 block.
* **FP4 routed-expert weights** (``ffn.experts.N.w{1,2,3}``): an ``int8`` tensor ``[out, in/2]``
  holding two e2m1 codes per byte (element ``2j`` in the low nibble, ``2j+1`` in the high
  nibble) plus a ``.scale`` tensor ``[out, in/32]``, one scale per 32 consecutive inputs.
* Every scale is stored as ``float8_e8m0fnu`` (safetensors ``F8_E8M0``): an unsigned 8-bit
  exponent, i.e. a pure power of two ``2**(byte - 127)`` ("ue8m0", ``scale_fmt: "ue8m0"``).

``dequant = code_value * scale`` with the scale broadcast over its block. Because scales are
powers of two, dividing by them is exact, which is what makes the round trips in the tests
bit-exact for values already on the grid.

Everything here is plain torch and runs on CPU and CUDA. The quantisers exist to build test
checkpoints and to requantise; inference only ever needs the dequantisers (or fused kernels
that reproduce them).
"""

from __future__ import annotations

import functools

import torch

FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` magnitude."""

FP4_MAX = 6.0
"""Largest e2m1 magnitude."""

FP8_BLOCK = (128, 128)
"""Block shape (rows, columns) of one FP8 weight scale, from ``weight_block_size`` in config.json."""

FP4_GROUP = 32
"""Number of consecutive input elements sharing one FP4 scale."""

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Value of each 4-bit e2m1 code: bit 3 is the sign, bits 0-2 index the magnitude grid."""

# Midpoints between consecutive magnitudes of the e2m1 grid, used for round-to-nearest.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

# Exponent range of float8_e8m0fnu: byte 0 is 2**-127, byte 254 is 2**127, byte 255 is NaN.
_E8M0_MIN_EXP = -127
_E8M0_MAX_EXP = 127

_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float32)
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def ue8m0_scale(amax: torch.Tensor, max_value: float = FP8_MAX) -> torch.Tensor:
    """Power-of-two scale ``2**ceil(log2(amax / max_value))`` for blocks whose largest magnitude is ``amax``.

    Rounding the exponent *up* guarantees ``amax / scale <= max_value``, so nothing saturates,
    and a power of two is exactly what a ue8m0 byte can hold. The exponent is computed with
    ``frexp`` rather than ``log2`` so powers of two land exactly (``log2`` can be off by an ulp).
    Blocks with ``amax == 0`` get the smallest ue8m0 scale, ``2**-127``; the exponent is
    clamped to the ue8m0 range ``[-127, 127]`` (an overflowing ratio gets ``2**127``).

    The official activation kernel (``act_quant`` in inference/kernel.py) first clamps
    ``amax`` to at least ``1e-4``; callers quantising activations should do the same.

    Args:
        amax: non-negative block maxima, any shape.
        max_value: largest representable code magnitude (448 for e4m3, 6 for e2m1).

    Returns:
        float32 tensor of powers of two, same shape as ``amax``.
    """
    if not amax.is_floating_point():
        raise ValueError(f"amax must be a floating tensor, got dtype {amax.dtype}")
    if max_value <= 0:
        raise ValueError(f"max_value must be positive, got {max_value}")
    ratio = amax.float() / max_value
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2**exponent, mantissa in [0.5, 1)
    # ceil(log2(ratio)) is exponent - 1 when ratio is exactly a power of two, otherwise exponent.
    ceil_log2 = exponent - (mantissa == 0.5).to(exponent.dtype)
    ceil_log2 = torch.where(ratio > 0, ceil_log2, torch.full_like(ceil_log2, _E8M0_MIN_EXP))
    ceil_log2 = torch.where(torch.isinf(ratio), torch.full_like(ceil_log2, _E8M0_MAX_EXP), ceil_log2)
    ceil_log2 = ceil_log2.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)
    return torch.ldexp(torch.ones_like(ratio), ceil_log2)


# --------------------------------------------------------------------------------------------
# FP8 e4m3, 128x128 blocks
# --------------------------------------------------------------------------------------------


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block):
        raise ValueError(f"block must be two positive ints (rows, cols), got {block!r}")
    return block[0], block[1]


def _check_finite(weight: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(weight).all()):
        raise ValueError(f"{what} contains NaN or infinite values; they have no block-scaled encoding")


def _check_scales_fit(
    scale: torch.Tensor, expected: tuple, values: torch.Tensor, names: tuple[str, str], blocks
) -> None:
    """One clear error where ``scale`` is not ``expected``'s shape for ``values`` (``names``: how the message calls
    the values' shape and the values; ``blocks``: the block or group the scales cover) or lies on another device."""
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match {names[0]} shape {tuple(values.shape)} "
            f"with {blocks}: expected {expected}"
        )
    if scale.device != values.device:
        raise ValueError(f"scale is on {scale.device} but {names[1]} is on {values.device}")


def _fp8_scale_shape(shape: torch.Size, block: tuple[int, int]) -> tuple[int, ...]:
    rows, cols = shape[-2], shape[-1]
    return (*shape[:-2], -(-rows // block[0]), -(-cols // block[1]))


def _pad_to_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Zero-pad the last two axes up to whole blocks (partial edge blocks become full ones)."""
    rows, cols = x.shape[-2], x.shape[-1]
    pad_rows = -rows % block[0]
    pad_cols = -cols % block[1]
    if pad_rows == 0 and pad_cols == 0:
        return x
    return torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows))


def _as_blocks(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """View ``[..., R, C]`` (whole blocks) as ``[..., R/br, br, C/bc, bc]``."""
    *lead, rows, cols = x.shape
    return x.reshape(*lead, rows // block[0], block[0], cols // block[1], block[1])


def quantize_fp8_blockwise(
    weight: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    scale_dtype: torch.dtype = torch.float8_e8m0fnu,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``weight [..., out, in]`` to ``float8_e4m3fn`` with one power-of-two scale per block.

    Each ``block = (rows, cols)`` tile gets ``scale = ue8m0_scale(max|tile|)``; codes are
    ``clamp(weight / scale, -448, 448)`` rounded to nearest-even e4m3. Edge tiles that are only
    partially covered by the matrix get a scale of their own computed from the elements that
    exist, so the scale grid is ``[..., ceil(out/rows), ceil(in/cols)]`` exactly like the
    checkpoint's ``.scale`` tensors.

    Args:
        weight: floating tensor with at least two dims; leading dims are batch (e.g. stacked experts).
        block: scale block shape; the checkpoint uses (128, 128).
        scale_dtype: ``torch.float8_e8m0fnu`` (what the checkpoint stores, ``F8_E8M0``) or
            ``torch.float32`` (what the reference model uses when ``scale_dtype="fp32"``).

    Returns:
        ``(fp8_weight, scale)`` with shapes ``[..., out, in]`` and ``[..., ceil(out/r), ceil(in/c)]``.
    """
    block = _check_block(block)
    if weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"weight must be float32/float64/bfloat16/float16, got dtype {weight.dtype}")
    if weight.dim() < 2:
        raise ValueError(f"weight must have at least 2 dims [..., out, in], got shape {tuple(weight.shape)}")
    if weight.numel() == 0:
        raise ValueError(f"weight is empty, shape {tuple(weight.shape)}")
    if scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be torch.float8_e8m0fnu or torch.float32, got {scale_dtype}")
    _check_finite(weight, "weight")

    rows, cols = weight.shape[-2], weight.shape[-1]
    # Zero padding never changes a block maximum, so padded edge blocks see only real elements.
    tiles = _as_blocks(_pad_to_blocks(weight.float(), block), block)
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., out_blocks, in_blocks]
    scale = ue8m0_scale(amax, FP8_MAX)
    codes = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    codes = codes.flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols]
    return codes.to(torch.float8_e4m3fn).contiguous(), scale.to(scale_dtype)


def dequantize_fp8_blockwise(
    fp8_weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Expand a block-scaled ``float8_e4m3fn`` weight back to ``dtype``: ``w[i, j] * scale[i // r, j // c]``.

    Args:
        fp8_weight: ``float8_e4m3fn`` tensor ``[..., out, in]``.
        scale: ``[..., ceil(out/r), ceil(in/c)]`` in ``float8_e8m0fnu`` or ``float32``.
        block: the block shape the scales were computed for.
        dtype: output dtype; the product is formed in float32 first, which is exact for
            e4m3 values times powers of two (barring float32 over/underflow).
    """
    block = _check_block(block)
    if fp8_weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_weight must be torch.float8_e4m3fn, got dtype {fp8_weight.dtype}")
    if fp8_weight.dim() < 2:
        raise ValueError(f"fp8_weight must have at least 2 dims [..., out, in], got {tuple(fp8_weight.shape)}")
    if scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"scale must be torch.float8_e8m0fnu or torch.float32, got dtype {scale.dtype}")
    _check_scales_fit(
        scale, _fp8_scale_shape(fp8_weight.shape, block), fp8_weight, ("weight", "fp8_weight"), f"block {block}"
    )

    rows, cols = fp8_weight.shape[-2], fp8_weight.shape[-1]
    tiles = _as_blocks(_pad_to_blocks(fp8_weight.float(), block), block)
    out = tiles * scale.float()[..., :, None, :, None]
    out = out.flatten(-4, -3).flatten(-2, -1)[..., :rows, :cols]
    return out.to(dtype).contiguous()


# --------------------------------------------------------------------------------------------
# FP4 e2m1, 1x32 groups, two codes per byte
# --------------------------------------------------------------------------------------------


@functools.cache
def device_constant(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A small float32 table on ``device``, made once per device and never written.

    Made per call, it would be copied from pageable host memory every step: a synchronisation on a GPU, which a
    CUDA graph capture refuses.
    """
    return torch.tensor(values, dtype=torch.float32, device=device)


def _e2m1_table(device: torch.device) -> torch.Tensor:
    return device_constant(E2M1_VALUES, torch.device(device))


def round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float values (already divided by their scale) to 4-bit e2m1 codes, as ``uint8`` in [0, 15].

    Magnitudes above 6 saturate to 6. Rounding is to nearest with ties to the even code,
    which is what the hardware float->e2m1 conversion (round-to-nearest-even) does: e.g.
    0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 2.5 -> 2, 5 -> 4. The sign bit is copied from the
    input (``signbit``), so tiny negatives and -0.0 become code 8, as the hardware conversion does.
    """
    mag = x.float().abs()
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for lower_code, midpoint in enumerate(_E2M1_MIDPOINTS):
        # At an exact midpoint go to the even code: up when the lower code is odd.
        go_up = mag >= midpoint if lower_code % 2 == 1 else mag > midpoint
        codes += go_up.to(torch.uint8)
    codes |= torch.signbit(x).to(torch.uint8) << 3
    return codes


def pack_e2m1_codes(codes: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
    """Pack 4-bit codes ``[..., n]`` (n even) into ``int8 [..., n/2]``.

    Element ``2j`` goes to the low nibble of byte ``j`` and element ``2j+1`` to the high nibble,
    the order the official convert.py unpacks (``low = x & 0xF`` first) and the order of
    torch's ``float4_e2m1fn_x2``. ``validate=False`` skips the range check (a device synchronisation)
    for codes that come from the rounding itself, as on the cache's write path.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"codes must be torch.uint8, got dtype {codes.dtype}")
    if codes.dim() < 1 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"codes last dim must be even, got shape {tuple(codes.shape)}")
    if validate and bool((codes > 15).any()):
        raise ValueError("codes must lie in [0, 15]")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.view(torch.int8)


def unpack_e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1_codes`: ``[..., n/2]`` packed bytes -> ``uint8 [..., n]`` codes.

    Accepts ``int8`` (checkpoint storage), ``uint8`` or ``float4_e2m1fn_x2`` (the reference
    model's in-memory dtype; same bytes, same nibble order).
    """
    if packed.dtype not in (torch.int8, torch.uint8, torch.float4_e2m1fn_x2):
        raise ValueError(f"packed must be int8, uint8 or float4_e2m1fn_x2, got dtype {packed.dtype}")
    if packed.dim() < 1:
        raise ValueError("packed must have at least 1 dim")
    raw = packed.view(torch.uint8)
    low = raw & 0x0F
    high = raw >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def quantize_fp4(
    weight: torch.Tensor,
    group: int = FP4_GROUP,
    scale_dtype: torch.dtype = torch.float8_e8m0fnu,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``weight [..., in]`` to packed e2m1 with one power-of-two scale per ``group`` inputs.

    ``scale = ue8m0_scale(max|group|, 6)``, codes are ``weight / scale`` rounded to the e2m1
    grid (nearest, ties to even). This is the layout of the checkpoint's routed experts: for
    ``weight [out, in]`` you get ``packed int8 [out, in/2]`` and ``scale [out, in/32]``.

    Args:
        weight: floating tensor; the last axis is the one grouped and packed (the GEMM's K axis).
        group: elements per scale; the checkpoint uses 32.
        scale_dtype: ``torch.float8_e8m0fnu`` (checkpoint ``F8_E8M0``) or ``torch.float32``.
    """
    if not isinstance(group, int) or group <= 0 or group % 2 != 0:
        raise ValueError(f"group must be a positive even int, got {group!r}")
    if weight.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"weight must be float32/float64/bfloat16/float16, got dtype {weight.dtype}")
    if weight.dim() < 1 or weight.numel() == 0:
        raise ValueError(f"weight must be a non-empty tensor, got shape {tuple(weight.shape)}")
    if weight.shape[-1] % group != 0:
        raise ValueError(f"weight last dim {weight.shape[-1]} is not a multiple of group {group}")
    if scale_dtype not in _SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be torch.float8_e8m0fnu or torch.float32, got {scale_dtype}")
    _check_finite(weight, "weight")

    groups = weight.float().unflatten(-1, (-1, group))  # [..., in/group, group]
    scale = ue8m0_scale(groups.abs().amax(dim=-1), FP4_MAX)  # [..., in/group]
    codes = round_to_e2m1_codes(groups / scale[..., None]).flatten(-2)
    return pack_e2m1_codes(codes), scale.to(scale_dtype)


def dequantize_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    group: int = FP4_GROUP,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Expand packed e2m1 ``[..., in/2]`` with scales ``[..., in/group]`` to ``dtype [..., in]``.

    ``out[..., k] = E2M1_VALUES[code(k)] * scale[..., k // group]`` where code ``2j`` is the low
    nibble of byte ``j``. Exact in float32 (e2m1 values times powers of two).
    """
    if not isinstance(group, int) or group <= 0 or group % 2 != 0:
        raise ValueError(f"group must be a positive even int, got {group!r}")
    codes = unpack_e2m1_codes(packed)  # validates packed
    if scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"scale must be torch.float8_e8m0fnu or torch.float32, got dtype {scale.dtype}")
    n = codes.shape[-1]
    if n % group != 0:
        raise ValueError(f"unpacked last dim {n} (packed {packed.shape[-1]} x 2) is not a multiple of group {group}")
    _check_scales_fit(scale, (*packed.shape[:-1], n // group), packed, ("packed", "packed"), f"group {group}")

    values = _e2m1_table(packed.device)[codes.long()]
    out = values.unflatten(-1, (-1, group)) * scale.float()[..., None]
    return out.flatten(-2).to(dtype)
