"""V4.1's fake quantization in one Triton kernel per call: ``fake_quant_fp8`` and ``fake_quant_fp4``.

The torch reference rounds a block through about twenty elementwise kernels (the power-of-two ceiling from the
float's bits, the e2m1 rounding as seven compares, casts between them), and a decode step rounds eleven times:
window KV, compressed KV, index keys and index queries. Here one program rounds a tile of blocks in registers.

Bit-identical to the reference, with no float8 cast and no approximate arithmetic:

* the power-of-two ceiling reads the float's exponent and mantissa fields, as :func:`pow2_ceil` does, and
  builds ``2**e`` from its bits (``e >= -126``: every amax floor keeps the product normal or one below);
* division by a power of two is the exact product with its reciprocal (also built from bits); division by
  an e4m3 scale (FP4 with e4m3 scales) is IEEE ``div_rn``, as torch divides;
* e4m3 rounding (FP8 codes, and the FP4 e4m3 scales) scales the magnitude to an integer count of its binade's
  quantum (``2**(e - 3)``, subnormal binade ``2**-9``) and rounds it to nearest even with the float32 magic
  number ``2**23`` (add, then subtract: exact for counts below ``2**22``); the sign bit is copied, so ``-0``
  stays ``-0`` as the cast keeps it;
* e2m1 rounding is the reference's seven midpoint compares (ties to the even code), the sign from the sign bit.

The helpers are shared with the cache codec kernels (:mod:`dsinfer.ops.cache_codec.triton`), which store the
same codes and scales as bytes.
"""

from __future__ import annotations

import torch

from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ELEMENTS_PER_PROGRAM = 4096  # blocks x channels one program rounds: 16 KiB of float32 in registers
KIND_FP8, KIND_FP4_E4M3, KIND_FP4_UE8M0 = 0, 1, 2


if triton is not None:

    @triton.jit
    def pow2(e):
        """``2**e`` (float32) for integer ``e`` in [-126, 127], from its bits."""
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def pow2_ceil_exponent(t):
        """``ceil(log2(t))`` of positive float32 ``t`` from its fields, as the reference's ``pow2_ceil``."""
        bits = t.to(tl.int32, bitcast=True)
        exponent = (bits >> 23) & 0xFF
        return exponent - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)

    @triton.jit
    def with_sign_of(magnitude, signed):
        """``magnitude`` (non-negative float32) with the sign bit of ``signed`` (keeps -0)."""
        sign = signed.to(tl.int32, bitcast=True) & -2147483648
        return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def round_e4m3(v):
        """``v`` (float32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, sign kept."""
        magnitude = tl.abs(v)
        exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        exponent = tl.maximum(exponent, -6)  # the subnormal binade shares the quantum 2**-9
        count = magnitude * pow2(3 - exponent)  # exact: a power of two
        count = (count + 8388608.0) - 8388608.0  # round to an integer, nearest even
        return with_sign_of(count * pow2(exponent - 3), v)

    @triton.jit
    def e2m1_count(magnitude):
        """The e2m1 magnitude code (0..7) nearest ``magnitude`` (already clamped to 6), ties to the even code."""
        code = (magnitude > 0.25).to(tl.int32) + (magnitude >= 0.75).to(tl.int32)
        code += (magnitude > 1.25).to(tl.int32) + (magnitude >= 1.75).to(tl.int32)
        code += (magnitude > 2.5).to(tl.int32) + (magnitude >= 3.5).to(tl.int32)
        return code + (magnitude > 5.0).to(tl.int32)

    @triton.jit
    def e2m1_magnitude(code):
        """The value of magnitude code ``code`` (0..7): 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
        low = code.to(tl.float32) * 0.5
        high = tl.where(code == 7, 6.0, (code - 2).to(tl.float32))
        return tl.where(code < 4, low, high)

    @triton.jit
    def block_scale(amax, KIND: tl.constexpr):
        """Each block's scale (float32) and its reciprocal (``0`` for e4m3 scales, which divide instead)."""
        if KIND == 0:  # FP8 e4m3 codes, ue8m0 scales
            exponent = pow2_ceil_exponent(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
            return pow2(exponent), pow2(-exponent)
        elif KIND == 1:  # FP4, e4m3 scales
            scale = round_e4m3(tl.math.div_rn(tl.maximum(amax, 6.0 * 2.0**-9), tl.full(amax.shape, 6.0, tl.float32)))
            return scale, tl.zeros_like(scale)
        else:  # FP4, ue8m0 scales
            exponent = pow2_ceil_exponent(tl.maximum(amax, 6.0 * 2.0**-126) * (1.0 / 6.0))
            return pow2(exponent), pow2(-exponent)

    @triton.jit
    def scaled(x, scale, inverse, KIND: tl.constexpr):
        """``x / scale``: the exact product with a power of two's reciprocal, or IEEE division by an e4m3 scale."""
        if KIND == 1:
            return tl.math.div_rn(x, scale)
        return x * inverse

    @triton.jit
    def _fake_quant_kernel(x_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr, KIND: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        channels = tl.arange(0, BLOCK)
        mask = (rows < n_blocks)[:, None]
        offsets = rows[:, None] * BLOCK + channels[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale, inverse = block_scale(amax, KIND)
        if KIND == 0:
            v = scaled(x, scale[:, None], inverse[:, None], KIND)
            v = tl.minimum(tl.maximum(v, -448.0), 448.0)
            out = round_e4m3(v) * scale[:, None]
        else:
            v = scaled(x, scale[:, None], inverse[:, None], KIND)
            v = tl.minimum(tl.maximum(v, -6.0), 6.0)
            out = with_sign_of(e2m1_magnitude(e2m1_count(tl.abs(v))), v) * scale[:, None]
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def serves(x: torch.Tensor, block: int) -> bool:
    """Whether the kernel takes ``x`` (else the reference runs): a float tensor of whole power-of-two blocks."""
    return (
        x.dtype in DTYPES
        and x.dim() >= 1
        and block > 0
        and block & (block - 1) == 0
        and x.shape[-1] % block == 0
        and not x.requires_grad
    )


def fake_quant_launch(x: torch.Tensor, block: int, kind: int) -> torch.Tensor:
    """The kernel: a new contiguous tensor shaped and typed like ``x``."""
    source = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_blocks = source.numel() // block
    if n_blocks == 0:
        return out
    rows = min(max(1, ELEMENTS_PER_PROGRAM // block), triton.next_power_of_2(n_blocks))
    _fake_quant_kernel[(triton.cdiv(n_blocks, rows),)](source, out, n_blocks, BLOCK=block, ROWS=rows, KIND=kind,
                                                        num_warps=4)  # fmt: skip
    return out


@register("fake_quant_fp8", "triton", devices=("cuda",), available=triton_available, priority=10)
def fake_quant_fp8_triton(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Same contract and bits as the reference; other inputs go to it."""
    if not serves(x, block):
        from dsinfer.ops.fake_quant.reference import fake_quant_fp8

        return fake_quant_fp8(x, block)
    return fake_quant_launch(x, block, KIND_FP8)


@register("fake_quant_fp4", "triton", devices=("cuda",), available=triton_available, priority=10)
def fake_quant_fp4_triton(x: torch.Tensor, block: int, e4m3_scales: bool) -> torch.Tensor:
    """Same contract and bits as the reference; other inputs go to it."""
    if not serves(x, block):
        from dsinfer.ops.fake_quant.reference import fake_quant_fp4

        return fake_quant_fp4(x, block, e4m3_scales)
    return fake_quant_launch(x, block, KIND_FP4_E4M3 if e4m3_scales else KIND_FP4_UE8M0)
