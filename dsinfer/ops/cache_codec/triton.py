"""V4.1's cache codecs in Triton: ``cache_encode`` and ``cache_decode``, one kernel each per call.

The torch reference encodes a compressed-KV row through some forty kernels (seven candidate scales tried at once,
every e2m1 rounding as compares) and decodes through a table gather, casts and a multiply; a decode step with
``quantized_storage`` encodes every new window row, entry and index key and decodes every ring and entry it reads.
Here each program handles a tile of blocks in registers and reads or writes the bytes the cache stores.

The rounding is the fake quantizer's Triton arithmetic (:mod:`dsinfer.ops.fake_quant.triton`), so codes and
scales are the reference's bit for bit: FP8 codes are written as e4m3 bit patterns (sign, 4-bit exponent with
bias 7, 3-bit mantissa; the subnormal binade below ``2**-6``), ue8m0 scales as their exponent byte, e4m3 scales
(compressed KV) by the reference's lossless search: the rule's scale, then ``amax / m`` for each smaller e2m1
magnitude ``m``, the first that is an e4m3 value under which every element is a code. Decoding forms
``value * scale`` in float32 (exact) and rounds once to the output dtype, as the reference does.
"""

from __future__ import annotations

import torch

from dsinfer.ops.cache_codec.reference import CacheStoreInputs
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

if triton is not None:
    from dsinfer.ops.fake_quant.triton import (
        block_scale,
        e2m1_count,
        e2m1_magnitude,
        pow2,
        pow2_ceil_exponent,
        round_e4m3,
        with_sign_of,
    )

ELEMENTS_PER_PROGRAM = 4096
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# element, scale -> the kernels' KIND (the fake quantizer's numbering)
KINDS = {("e4m3", "ue8m0"): 0, ("e2m1", "e4m3"): 1, ("e2m1", "ue8m0"): 2}

if triton is not None:

    @triton.jit
    def e4m3_bits(v):
        """The e4m3fn byte (int32) of ``v``, a float32 that is an e4m3 value."""
        magnitude = tl.abs(v)
        bits = magnitude.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127
        normal = (exponent + 7) * 8 + ((bits >> 20) & 0x7)
        subnormal = (magnitude * 512.0).to(tl.int32)  # 2**-9 quanta
        code = tl.where(magnitude >= 0.015625, normal, subnormal)
        return code | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)

    @triton.jit
    def with_sign_bit(magnitude, negative):
        """``magnitude`` (non-negative float32) with its sign bit set where ``negative``: -0 stays -0 (on CUDA,
        ``tl.where(negative, -magnitude, magnitude)`` gave +0 for the negative-zero code)."""
        sign = negative.to(tl.int32) << 31
        return (magnitude.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)

    @triton.jit
    def e4m3_value(code):
        """The float32 value of e4m3fn byte ``code`` (int32)."""
        exponent = (code >> 3) & 0xF
        mantissa = (code & 0x7).to(tl.float32)
        magnitude = tl.where(exponent == 0, mantissa * 0.001953125, (8.0 + mantissa) * pow2(exponent - 10))
        return with_sign_bit(magnitude, (code & 0x80) != 0)

    @triton.jit
    def ue8m0_value(byte):
        """``2**(byte - 127)`` (float32; byte 0 is the subnormal ``2**-127``)."""
        return tl.where(byte == 0, 5.877471754111438e-39, pow2(tl.maximum(byte, 1) - 127))

    @triton.jit
    def _lossless_e4m3_scale(x, amax):
        """The reference's choice of e4m3 scale for FP4 rows ``x`` [R, C] on the grid: the rule's scale if every
        element is a code under it, else the first ``amax / m`` (``m`` = 4, 3, 2, 1.5, 1, 0.5) that is a positive
        e4m3 value under which every element is a code, else the rule's.

        The seven candidates are tried side by side ([R, 8, C], the eighth slot unused): the same divisions and
        comparisons as one try after another, but one chain of dependent steps instead of seven. (On the H200 the
        V4.1 slice's fused coded stores took 32.4 us a step against 32.9 before: the search is not what they
        wait for; docs/perf.md, pass 9.)"""
        rule, unused = block_scale(amax, 1)
        j = tl.arange(0, 8)
        m = tl.where(j == 1, 4.0, tl.where(j == 2, 3.0, tl.where(j == 3, 2.0, tl.where(j == 4, 1.5, 1.0))))
        m = tl.where(j == 6, 0.5, m)
        divided = tl.math.div_rn(
            amax[:, None] + tl.zeros((1, 8), tl.float32), m[None, :] + tl.zeros_like(amax)[:, None]
        )
        candidate = tl.where(j[None, :] == 0, rule[:, None], divided)
        usable = (candidate > 0) & (round_e4m3(tl.minimum(candidate, 448.0)) == candidate) & (j[None, :] < 7)
        wide = x[:, None, :] + tl.zeros((1, 8, 1), tl.float32)
        v = tl.minimum(tl.maximum(tl.math.div_rn(wide, candidate[:, :, None] + tl.zeros_like(wide)), -6.0), 6.0)
        back = with_sign_of(e2m1_magnitude(e2m1_count(tl.abs(v))), v) * candidate[:, :, None]
        exact = usable & (tl.sum((back != wide).to(tl.int32), axis=2) == 0)
        first = tl.min(tl.where(exact, j[None, :], 8), axis=1)
        chosen = tl.sum(tl.where(j[None, :] == first[:, None], candidate, 0.0), axis=1)
        return tl.where(first < 8, chosen, rule)

    @triton.jit
    def encode_fp8_blocks(x):
        """float32 blocks ``x [N, B]`` -> their e4m3 code bytes ``[N, B]`` and ue8m0 scale bytes ``[N]`` (uint8)."""
        amax = tl.max(tl.abs(x), axis=1)
        exponent = pow2_ceil_exponent(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
        v = tl.minimum(tl.maximum(x * pow2(-exponent)[:, None], -448.0), 448.0)
        return e4m3_bits(round_e4m3(v)).to(tl.uint8), (exponent + 127).to(tl.uint8)

    @triton.jit
    def encode_fp4_blocks(x, KIND: tl.constexpr):
        """float32 blocks as channel pairs ``x [N, B/2, 2]`` -> packed e2m1 bytes ``[N, B/2]`` (channel ``2j`` in
        the low nibble of byte ``j``) and scale bytes ``[N]`` (uint8): e4m3 by the lossless search (``KIND`` 1)
        or ue8m0 (``KIND`` 2)."""
        amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
        if KIND == 1:
            scale = _lossless_e4m3_scale(tl.reshape(x, [x.shape[0], x.shape[1] * 2]), amax)
            v = tl.math.div_rn(x, scale[:, None, None])
            scale_byte = e4m3_bits(scale)
        else:
            exponent = pow2_ceil_exponent(tl.maximum(amax, 6.0 * 2.0**-126) * (1.0 / 6.0))
            v = x * pow2(-exponent)[:, None, None]
            scale_byte = exponent + 127
        v = tl.minimum(tl.maximum(v, -6.0), 6.0)
        code = e2m1_count(tl.abs(v)) | ((v.to(tl.int32, bitcast=True) >> 28) & 0x8)
        low, high = tl.split(code)
        return (low | (high << 4)).to(tl.uint8), scale_byte.to(tl.uint8)

    @triton.jit
    def _encode_kernel(x_ptr, codes_ptr, scales_ptr, n_blocks, first_ptr, second_ptr, second_size, modulus,
                       BLOCK: tl.constexpr, ROWS: tl.constexpr, KIND: tl.constexpr, BLOCKS_PER_ROW: tl.constexpr,
                       SCATTER: tl.constexpr, HAS_MODULUS: tl.constexpr):  # fmt: skip
        """Blocks ``rows`` of x encoded; ``SCATTER``: value row r's blocks go to pool row (first[r], second[r])
        (second modulo ``modulus`` when given) of a pool [first, second_size, ...], else to the same blocks."""
        source = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        row_ok = source < n_blocks
        rows = source
        if SCATTER:
            value_row = source // BLOCKS_PER_ROW
            first = tl.load(first_ptr + value_row, mask=row_ok, other=0).to(tl.int64)
            second = tl.load(second_ptr + value_row, mask=row_ok, other=0).to(tl.int64)
            if HAS_MODULUS:
                second = second % modulus
            rows = (first * second_size + second) * BLOCKS_PER_ROW + source % BLOCKS_PER_ROW
        if KIND == 0:
            channels = tl.arange(0, BLOCK)
            x = tl.load(x_ptr + source[:, None] * BLOCK + channels[None, :], mask=row_ok[:, None], other=0.0)
            codes, scale_bytes = encode_fp8_blocks(x.to(tl.float32))
            tl.store(codes_ptr + rows[:, None] * BLOCK + channels[None, :], codes, mask=row_ok[:, None])
        else:
            HALF: tl.constexpr = BLOCK // 2
            pairs = tl.arange(0, HALF)
            offsets = source[:, None, None] * BLOCK + 2 * pairs[None, :, None] + tl.arange(0, 2)[None, None, :]
            x = tl.load(x_ptr + offsets, mask=row_ok[:, None, None], other=0.0).to(tl.float32)
            packed, scale_bytes = encode_fp4_blocks(x, KIND)
            tl.store(codes_ptr + rows[:, None] * HALF + pairs[None, :], packed, mask=row_ok[:, None])
        tl.store(scales_ptr + rows, scale_bytes, mask=row_ok)

    @triton.jit
    def _decode_kernel(codes_ptr, scales_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                       KIND: tl.constexpr):  # fmt: skip
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
        row_ok = rows < n_blocks
        byte = tl.load(scales_ptr + rows, mask=row_ok, other=0).to(tl.int32)
        if KIND == 1:
            scale = e4m3_value(byte)
        else:
            scale = ue8m0_value(byte)
        if KIND == 0:
            offsets = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
            code = tl.load(codes_ptr + offsets, mask=row_ok[:, None], other=0).to(tl.int32)
            values = e4m3_value(code) * scale[:, None]
            tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            HALF: tl.constexpr = BLOCK // 2
            pairs = tl.arange(0, HALF)
            packed = tl.load(codes_ptr + rows[:, None] * HALF + pairs[None, :], mask=row_ok[:, None], other=0)
            packed = packed.to(tl.int32)
            code = tl.join(packed & 0xF, (packed >> 4) & 0xF)  # [R, HALF, 2]: channel 2j low, 2j + 1 high
            magnitude = e2m1_magnitude(code & 0x7)
            values = with_sign_bit(magnitude, (code & 0x8) != 0) * scale[:, None, None]
            offsets = rows[:, None, None] * BLOCK + 2 * pairs[None, :, None] + tl.arange(0, 2)[None, None, :]
            tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=row_ok[:, None, None])

    @triton.jit
    def _store_rows_kernel(x_ptr, data_ptr, first_ptr, second_ptr, second_size, modulus, channels,
                           BLOCK_C: tl.constexpr, HAS_MODULUS: tl.constexpr):  # fmt: skip
        """Value row r (cast to the pool's dtype) to pool row (first[r], second[r] [% modulus])."""
        row = tl.program_id(0).to(tl.int64)
        first = tl.load(first_ptr + row).to(tl.int64)
        second = tl.load(second_ptr + row).to(tl.int64)
        if HAS_MODULUS:
            second = second % modulus
        dest = data_ptr + (first * second_size + second) * channels
        for start in range(0, channels, BLOCK_C):
            channel = start + tl.arange(0, BLOCK_C)
            ok = channel < channels
            values = tl.load(x_ptr + row * channels + channel, mask=ok)
            tl.store(dest + channel, values.to(data_ptr.dtype.element_ty), mask=ok)


def _rows_per_program(block: int, n_blocks: int) -> int:
    return min(max(1, ELEMENTS_PER_PROGRAM // block), triton.next_power_of_2(max(n_blocks, 1)))


def encoding_kind(element: str, block: int, scale: str) -> int | None:
    """The encode kernels' KIND for a format (:data:`KINDS`), None for one they do not take."""
    kind = KINDS.get((element, scale))
    if kind is None or block < 2 or block & (block - 1):
        return None
    return kind


@register("cache_encode", "triton", devices=("cuda",), available=triton_available, priority=10)
def cache_encode_triton(
    values: torch.Tensor, element: str, block: int, scale: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and bytes as the reference; formats or inputs the kernel does not take go to it."""
    kind = encoding_kind(element, block, scale)
    if kind is None or values.dtype not in OUT_DTYPES or values.dim() < 1 or values.shape[-1] % block:
        from dsinfer.ops.cache_codec.reference import cache_encode_reference

        return cache_encode_reference(values, element, block, scale)
    source = values.contiguous()
    channels = values.shape[-1]
    width = channels if element == "e4m3" else channels // 2
    codes = torch.empty(*values.shape[:-1], width, dtype=torch.uint8, device=values.device)
    scales = torch.empty(*values.shape[:-1], channels // block, dtype=torch.uint8, device=values.device)
    n_blocks = source.numel() // block
    if n_blocks:
        rows = _rows_per_program(block, n_blocks)
        _encode_kernel[(triton.cdiv(n_blocks, rows),)](source, codes, scales, n_blocks, source, source, 0, 0,
                                                        BLOCK=block, ROWS=rows, KIND=kind, BLOCKS_PER_ROW=1,
                                                        SCATTER=False, HAS_MODULUS=False, num_warps=4)  # fmt: skip
    if element == "e4m3":
        codes = codes.view(torch.float8_e4m3fn)
    return codes, scales.view(torch.float8_e4m3fn) if scale == "e4m3" else scales


@register("cache_decode", "triton", devices=("cuda",), available=triton_available, priority=10)
def cache_decode_triton(
    codes: torch.Tensor, scales: torch.Tensor, element: str, block: int, scale: str, dtype: torch.dtype
) -> torch.Tensor:
    """Same contract and values as the reference; formats or inputs the kernel does not take go to it."""
    kind = encoding_kind(element, block, scale)
    if kind is None or dtype not in OUT_DTYPES or codes.dim() < 1:
        from dsinfer.ops.cache_codec.reference import cache_decode_reference

        return cache_decode_reference(codes, scales, element, block, scale, dtype)
    channels = codes.shape[-1] * (1 if element == "e4m3" else 2)
    out = torch.empty(*codes.shape[:-1], channels, dtype=dtype, device=codes.device)
    n_blocks = out.numel() // block
    if n_blocks:
        rows = _rows_per_program(block, n_blocks)
        code_bytes, scale_bytes = codes.contiguous().view(torch.uint8), scales.contiguous().view(torch.uint8)
        _decode_kernel[(triton.cdiv(n_blocks, rows),)](code_bytes, scale_bytes, out, n_blocks, BLOCK=block,
                                                        ROWS=rows, KIND=kind, num_warps=4)  # fmt: skip
    return out


@register("cache_store", "triton", devices=("cuda",), available=triton_available, priority=10)
def cache_store_triton(inputs: CacheStoreInputs) -> None:
    """Same contract and bytes as the reference, one launch; pools or rows the kernels do not take go to it."""
    values, data, scales, first, second, modulus = (inputs.values, inputs.data, inputs.scales, inputs.first,
                                                     inputs.second, inputs.modulus)  # fmt: skip
    element, block, scale = inputs.element, inputs.block, inputs.scale
    kind = None if scales is None else encoding_kind(element, block, scale)
    rows, channels = (values.shape[0], values.shape[-1]) if values.dim() == 2 else (0, 0)
    plain_ok = scales is None and values.dim() == 2 and data.dtype in OUT_DTYPES
    coded_ok = kind is not None and values.dim() == 2 and values.dtype in OUT_DTYPES and channels % block == 0
    if not (plain_ok or coded_ok) or data.dim() != 3 or not data.is_contiguous() or first.shape != (rows,):
        from dsinfer.ops.cache_codec.reference import cache_store_reference

        return cache_store_reference(inputs)
    if rows == 0:
        return None
    source, first, second = values.contiguous(), first.contiguous(), second.contiguous()
    if scales is None:
        block_c = min(1024, triton.next_power_of_2(channels))
        _store_rows_kernel[(rows,)](source, data, first, second, data.shape[1], modulus or 0, channels,
                                    BLOCK_C=block_c, HAS_MODULUS=modulus is not None, num_warps=4)  # fmt: skip
        return None
    n_blocks = rows * (channels // block)
    per_program = _rows_per_program(block, n_blocks)
    _encode_kernel[(triton.cdiv(n_blocks, per_program),)](
        source, data.view(torch.uint8), scales.view(torch.uint8), n_blocks, first, second, data.shape[1],
        modulus or 0, BLOCK=block, ROWS=per_program, KIND=kind, BLOCKS_PER_ROW=channels // block, SCATTER=True,
        HAS_MODULUS=modulus is not None, num_warps=4,
    )  # fmt: skip
    return None
