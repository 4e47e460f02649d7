"""A decode step's index scores in Triton: a split-K grid over (sequence, chunk of slots), every key read once.

The torch path gathers every block-table slot's keys into a new [B, W, d] tensor each step (and, with coded
storage, decodes it: more kernels and a second copy) before scoring. The first kernel here took one program per
(sequence, 16 slots), each reloading the sequence's whole query (64 heads x 128 in float32: 32 KiB) for 4 KiB of
keys and forming the products in IEEE float32 on the CUDA cores: at 64 sequences x 131,072 tokens it moved 54 GB/s.

Here the grid is (chunks, sequences): a program loads its sequence's query and head weights once, then walks its
chunk of slots ``BLOCK_E`` at a time, reading each tile's keys through the block table where they are stored (the
loop is software-pipelined, so several tiles' loads are in flight), and forms the [BLOCK_E, heads] products with
one ``tl.dot`` on the tensor cores: keys are the dot's rows (M), heads its columns (N), d its depth (K). The chunk
size spreads B x chunks over a few programs per multiprocessor (:func:`choose_chunk`), so one sequence or 256
fill the GPU alike and each key is read by exactly one program.

Arithmetic, exact where it can be: bf16 / fp16 keys against a query of their dtype multiply exactly into float32
sums; FP8 e4m3 codes and FP4 e2m1 codes times power-of-two (ue8m0) scales are bf16 values, decoded in registers;
an FP8 pool with one float32 scale a row multiplies the row's products by it after the dot. FP4 tiles take one of
four layouts (``paged_scores_launch(fp4_layout=...)``, ``DEFAULT_FP4_LAYOUT`` unless a caller names one).
``words`` (:mod:`.fp4_words`): the keys read as int32 words of 8 codes, two codes a shift and mask,
one dot, the decoded tile reaching the MMA through shared memory. That loop waits on latency more than it issues,
so it keeps more tiles in flight (``WORDS_STAGES``) and aims at more programs a multiprocessor
(``WORDS_PROGRAMS_PER_SM``, at least ``WORDS_MIN_TILES`` tiles a chunk) than the other layouts: on one H100 at 64
and 256 requests x 131,072 it takes 0.57 and 2.08 ms, 0.65 and 2.32 at the others' three stages, against
``halves``' 1.20 and 3.98 (``benchmarks/indexer_decode.py``). ``words_mma``, the default: on Hopper, V4.1's keys
decoded straight into the warpgroup MMA's register operand by a Gluon kernel (:mod:`.fp4_hopper`: no shared-memory
round trip for the decoded tile, one multiply a code pair; 373 instructions a tile against 460 in the sm_90 build;
0.36 and 1.38 ms at the same points); ``words`` elsewhere and for other shapes.
``halves``, where words do not fit: the even channels (each byte's low
nibble) and the odd ones (its high nibble) are two [BLOCK_E, d / 2] tiles, scored by two dots against the query's
even and odd channels (loaded once a chunk with a channel stride of 2), and each nibble becomes bf16 bits with
integer ops, the ue8m0 scale added to the exponent field (:func:`e2m1_bf16`: exact for every byte the codec writes).
``joined``: the nibbles interleaved into one [BLOCK_E, d] tile (``tl.join`` + ``tl.reshape``, a layout
shuffle) and decoded in float32. A query that is not of
the dot's dtype (float32, the tests' and some callers') is split into a high and a low bf16 half and takes two dots
(float32 keys likewise: three), which leaves about 2^-16 of each product's magnitude. Then ReLU, the head weights,
the sum over heads and 1 / sqrt(d); slots past the visible entries write -inf without reading a key. Sums run in
another order than torch's: scores agree to float32 rounding (plus the split's 2^-16) and exact zeros (every
head's ReLU at 0) stay exact (``tests/ops/test_index_scores_paged.py``, ``tests/ops/test_index_decode.py``).
"""

from __future__ import annotations

import functools

import torch

from dsinfer.ops.index_scores_paged.fp4_hopper import hopper_words_fits, hopper_words_launch
from dsinfer.ops.index_scores_paged.fp4_words import words_layout_fits, words_scores_launch
from dsinfer.ops.index_scores_paged.reference import PagedIndexInputs, index_scores_paged_reference, paged_key_form
from dsinfer.ops.index_scores_paged.tiles import fill_unseen, split_for_dot
from dsinfer.ops.registry import register
from dsinfer.ops.sparse_attention.triton import sparse_attention_triton_available

try:
    import triton
    import triton.language as tl

    from dsinfer.ops.cache_codec.triton import ue8m0_value
    from dsinfer.ops.fake_quant.triton import e2m1_magnitude

    DOT_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

BLOCK_E = 64  # slots per tile: the dot's M (a Hopper warpgroup MMA is 64 rows)
NUM_WARPS = 4
NUM_STAGES = 3  # key tiles in flight per program
PROGRAMS_PER_SM = 4  # B x chunks aims at this many programs per multiprocessor
WORDS_STAGES = 5  # the FP4 words kernel waits on loads more than it computes: deeper pipeline, more programs
WORDS_PROGRAMS_PER_SM = 8
WORDS_MIN_TILES = 4  # a words chunk's fewest tiles: eight programs a multiprocessor split one sequence too finely
MIN_TILES = 2  # a chunk's fewest tiles (the query is read once per chunk)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FORMS = {"plain": 0, "fp8": 1, "fp4": 2}
FP4_LAYOUTS = ("halves", "joined", "words", "words_mma")  # how FP4 tiles meet the query (module docstring)
DEFAULT_FP4_LAYOUT = "words_mma"
MIN_DOT_DEPTH = 16  # tl.dot's smallest K: the halves layout needs head_dim >= 32

if triton is not None:

    @triton.jit
    def _tile_keys(keys_ptr, scales_ptr, row, scale_row, seen, dims, dim_ok, HEAD_DIM: tl.constexpr,
                   SCALE_BLOCK: tl.constexpr, FORM: tl.constexpr, UE8M0: tl.constexpr,
                   ROW_SCALE: tl.constexpr):  # fmt: skip
        """One tile's keys [BLOCK_E, BLOCK_D] (coded ones decoded; FP4 and narrow FP8 blocks: float32, and
        BLOCK_D == HEAD_DIM) and each slot's float32 factor when the pool keeps one scale a row (``ROW_SCALE``,
        applied after the dot; else ones)."""
        factor = tl.full([row.shape[0]], 1.0, tl.float32)
        if FORM == 2:  # packed e2m1, channel 2j in the low nibble of byte j, a ue8m0 exponent per block
            pairs = tl.arange(0, HEAD_DIM // 2)
            packed = tl.load(keys_ptr + row[:, None] + pairs[None, :], mask=seen[:, None], other=0).to(tl.int32)
            code = tl.reshape(tl.join(packed & 0xF, packed >> 4), [row.shape[0], HEAD_DIM])
            magnitude = e2m1_magnitude(code & 0x7)
            exponent = tl.load(scales_ptr + scale_row[:, None] + (dims // SCALE_BLOCK)[None, :], mask=seen[:, None],
                               other=127)  # fmt: skip
            keys = tl.where((code & 0x8) != 0, -magnitude, magnitude) * ue8m0_value(exponent.to(tl.int32))
        else:
            keys = tl.load(keys_ptr + row[:, None] + dims[None, :], mask=seen[:, None] & dim_ok[None, :], other=0.0)
            if FORM == 1:
                if ROW_SCALE:
                    raw = tl.load(scales_ptr + scale_row, mask=seen, other=0)
                    factor = ue8m0_value(raw.to(tl.int32)) if UE8M0 else raw.to(tl.float32)
                else:  # ue8m0 blocks narrower than the row: code x power of two is a bf16 value
                    raw = tl.load(scales_ptr + scale_row[:, None] + (dims // SCALE_BLOCK)[None, :],
                                  mask=seen[:, None], other=127)  # fmt: skip
                    keys = keys.to(tl.float32) * ue8m0_value(raw.to(tl.int32))
        return keys, factor

    @triton.jit
    def e2m1_bf16(nibble, exponent_base, half_bits):
        """The bf16 value of e2m1 code ``nibble`` (0..15: bit 3 the sign, bits 0-2 the magnitude 0, 0.5, 1, 1.5,
        2, 3, 4, 6) times its block's scale ``2**(b - 127)``, built as bits with integer ops (no float decode).

        ``exponent_base`` is ``(b - 1) << 7`` and ``half_bits`` the bits of ``0.5 * 2**(b - 127)``
        (:func:`fp4_scale_fields`, once a byte for both nibbles). Magnitude codes 2..7 are the normal e2m1 values
        ``2**(e - 1) * (1 + m / 2)`` (``e`` = code >> 1, ``m`` = code & 1): shifted by 6 the code is the bf16 bits
        of ``2**(e - 127) * (1 + m / 2)``, and adding ``(b - 1) << 7`` adds ``b - 1`` to that exponent field, the
        scale applied exactly (an integer add, not a float multiply) while the field stays in 1..254. Code 1
        (the subnormal 0.5) has no implicit bit to shift, so it takes ``half_bits``; code 0 is zero; the sign is
        bit 15. Exact, bit for bit, for every scale the codec writes (:mod:`dsinfer.kv.codecs`): its amax floor
        gives ``b >= 1`` (b = 1 and code 1 is the bf16 subnormal ``2**-127``, in ``half_bits``), and a finite
        float block has amax < 2**128, so under ``b = 253`` no code exceeds 4 (exponent field 255: infinity, as
        the float32 reference overflows too); ``b = 0`` (never written) would need subnormals here as well."""
        magnitude = nibble & 0x7
        bits = tl.where(magnitude >= 2, (magnitude << 6) + exponent_base, tl.where(magnitude == 1, half_bits, 0))
        bits = bits | ((nibble & 0x8) << 12)
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def fp4_scale_fields(exponent):
        """For ue8m0 bytes ``exponent`` (int32): ``(b - 1) << 7`` and the bf16 bits of ``2**(b - 128)`` (a normal
        bf16 for ``b >= 2``, else the subnormal ``2**-127`` or ``2**-128``), what :func:`e2m1_bf16` adds and
        selects."""
        exponent_base = (exponent - 1) << 7
        half_bits = tl.where(exponent >= 2, exponent_base, tl.where(exponent == 1, 0x40, 0x20))
        return exponent_base, half_bits

    @triton.jit
    def _tile_fp4_halves(keys_ptr, scales_ptr, row, scale_row, seen, HEAD_DIM: tl.constexpr,
                         SCALE_BLOCK: tl.constexpr):  # fmt: skip
        """One tile of packed FP4 keys as two bf16 halves [BLOCK_E, HEAD_DIM / 2]: the even channels (low
        nibbles) and the odd ones (high nibbles), never interleaved. Channels ``2j`` and ``2j + 1`` share byte
        ``j`` and (``SCALE_BLOCK`` even) its scale block ``j // (SCALE_BLOCK / 2)``."""
        pairs = tl.arange(0, HEAD_DIM // 2)
        packed = tl.load(keys_ptr + row[:, None] + pairs[None, :], mask=seen[:, None], other=0).to(tl.int32)
        exponent = tl.load(scales_ptr + scale_row[:, None] + (pairs // (SCALE_BLOCK // 2))[None, :],
                           mask=seen[:, None], other=127).to(tl.int32)  # fmt: skip
        exponent_base, half_bits = fp4_scale_fields(exponent)
        even = e2m1_bf16(packed & 0xF, exponent_base, half_bits)
        odd = e2m1_bf16(packed >> 4, exponent_base, half_bits)
        return even, odd

    @triton.jit
    def _split_scores_kernel(
        q_ptr, weights_ptr, keys_ptr, scales_ptr, tables_ptr, visible_ptr, scores_ptr,
        n_heads, width, chunk, stride_qb, stride_qh, stride_wb, stride_kb, stride_kp, stride_sb_, stride_sp,
        stride_tb, stride_ob, scale,
        PER_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_E: tl.constexpr, FORM: tl.constexpr, UE8M0: tl.constexpr, ROW_SCALE: tl.constexpr,
        DOT: tl.constexpr, SPLIT_Q: tl.constexpr, PRECISION: tl.constexpr, BLOCK_D: tl.constexpr,
        NUM_STAGES: tl.constexpr, FP4_HALVES: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(1).to(tl.int64)
        first = tl.program_id(0) * chunk
        last = tl.minimum(first + chunk, width)
        scored_end = tl.minimum(last, tl.load(visible_ptr + seq).to(tl.int32))
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        out = scores_ptr + seq * stride_ob
        n_scored = tl.cdiv(tl.maximum(scored_end - first, 0), BLOCK_E)
        head_ok = heads < n_heads
        q_row = q_ptr + seq * stride_qb + heads[None, :] * stride_qh
        if FP4_HALVES:  # the even and the odd channels [HEAD_DIM / 2, BLOCK_H], each the right operand of a dot
            pairs = tl.arange(0, HEAD_DIM // 2)
            q_even = tl.load(q_row + 2 * pairs[:, None], mask=head_ok[None, :], other=0.0)
            q_odd = tl.load(q_row + 2 * pairs[:, None] + 1, mask=head_ok[None, :], other=0.0)
            q_high, q_low = split_for_dot(q_even, SPLIT_Q, DOT)
            q_odd_high, q_odd_low = split_for_dot(q_odd, SPLIT_Q, DOT)
        else:  # [BLOCK_D, BLOCK_H]: the dot's right operand, read once a chunk
            q = tl.load(q_row + dims[:, None], mask=head_ok[None, :] & dim_ok[:, None], other=0.0)
            q_high, q_low = split_for_dot(q, SPLIT_Q, DOT)
        weights = tl.load(weights_ptr + seq * stride_wb + heads, mask=head_ok, other=0.0).to(tl.float32)
        table = tables_ptr + seq * stride_tb
        for tile in tl.range(0, n_scored, num_stages=NUM_STAGES):
            entry = first + tile * BLOCK_E + tl.arange(0, BLOCK_E)
            seen = entry < scored_end
            block = tl.load(table + entry // PER_BLOCK, mask=seen, other=0).to(tl.int64)
            in_block = (entry % PER_BLOCK).to(tl.int64)
            key_row, scale_row = block * stride_kb + in_block * stride_kp, block * stride_sb_ + in_block * stride_sp
            if FP4_HALVES:
                even, odd = _tile_fp4_halves(keys_ptr, scales_ptr, key_row, scale_row, seen, HEAD_DIM, SCALE_BLOCK)
                products = tl.dot(even, q_high)
                products = tl.dot(odd, q_odd_high, products)
                if SPLIT_Q:
                    products = tl.dot(even, q_low, products)
                    products = tl.dot(odd, q_odd_low, products)
                products = tl.maximum(products, 0.0)
            else:
                keys, factor = _tile_keys(keys_ptr, scales_ptr, key_row, scale_row, seen, dims, dim_ok, HEAD_DIM,
                                          SCALE_BLOCK, FORM, UE8M0, ROW_SCALE)  # fmt: skip
                keys = keys.to(DOT)
                products = tl.dot(keys, q_high, input_precision=PRECISION)
                if SPLIT_Q:
                    products = tl.dot(keys, q_low, products)
                products = tl.maximum(products * factor[:, None], 0.0)
            summed = tl.sum(products * weights[None, :], axis=1) * scale
            tl.store(out + entry, tl.where(seen, summed, float("-inf")), mask=entry < last)
        fill_unseen(out, first, n_scored, last, BLOCK_E)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: a few chunks, so its tests cross chunk edges
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_chunk(batch: int, width: int, device: torch.device, programs_per_sm: int = PROGRAMS_PER_SM,
                 min_tiles: int = MIN_TILES) -> int:  # fmt: skip
    """Slots per program: enough programs for ``programs_per_sm`` a multiprocessor, whole tiles, at least
    ``min_tiles`` of them (shapes only: a CUDA graph replays the same split)."""
    tiles = triton.cdiv(width, BLOCK_E)
    splits = max(1, min(triton.cdiv(tiles, min_tiles), triton.cdiv(programs_per_sm * _sm_count(device), batch)))
    return triton.cdiv(tiles, splits) * BLOCK_E


def dot_dtypes(q: torch.Tensor, keys: torch.Tensor, form: str) -> tuple[torch.dtype, bool]:
    """The dot's operand dtype (float32: IEEE products, for float32 keys) and whether the query is split into a
    high and a low half of it (its own dtype is not the dot's)."""
    if form == "plain" and keys.dtype == torch.float32:
        return torch.float32, False
    dot = torch.float16 if form == "plain" and keys.dtype == torch.float16 else torch.bfloat16
    return dot, q.dtype != dot


def serves(q: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor | None) -> bool:
    """Whether the kernel takes these inputs (else the reference runs, and raises on malformed ones)."""
    if q.dim() != 3 or q.dtype not in DTYPES or q.stride(-1) != 1 or keys.stride(-1) != 1:
        return False
    head_dim = q.shape[-1]
    if head_dim < 16:
        return False
    try:
        form = paged_key_form(keys, key_scales, head_dim)
    except ValueError:
        return False
    if form == "plain":
        return keys.dtype in DTYPES and (keys.dtype == q.dtype or torch.float32 in (q.dtype, keys.dtype))
    scale_block = head_dim // key_scales.shape[-1]
    row_scale = scale_block == head_dim
    if head_dim & (head_dim - 1):  # coded rows are decoded whole: a power of two wide
        return False
    return key_scales.stride(-1) == 1 and scale_block >= 16 and (row_scale or key_scales.dtype == torch.uint8)


def paged_scores_launch(
    inputs: PagedIndexInputs,
    chunk: int | None = None,
    fp4_layout: str = DEFAULT_FP4_LAYOUT,
    words_launch: dict | None = None,
) -> torch.Tensor:
    """The kernel, no fallback (inputs :func:`serves` takes): scores [B, max_blocks * per_block] float32.
    ``chunk``: slots per program, a multiple of ``BLOCK_E`` (None: :func:`choose_chunk`). ``fp4_layout``: how
    FP4 tiles meet the query, ``"halves"`` (even and odd channels, two dots; ``"joined"`` below 32 channels,
    where a half is shallower than a dot), ``"words"`` (int32 words of 8 codes, :mod:`.fp4_words`; ``"halves"``
    where they do not fit), ``"words_mma"`` (the words decoded into the warpgroup MMA's register operand on
    Hopper, :mod:`.fp4_hopper`; ``"words"`` elsewhere) or ``"joined"`` (the codes interleaved into one float32
    tile). ``words_launch``: the words kernels' ``NUM_STAGES`` (and the Triton one's ``num_warps``) where they
    differ from the defaults (a benchmark's sweep)."""
    if fp4_layout not in FP4_LAYOUTS:
        raise ValueError(f"fp4_layout must be one of {FP4_LAYOUTS}, got {fp4_layout!r}")
    q, head_weights, keys, key_scales = inputs.q, inputs.head_weights, inputs.keys, inputs.key_scales
    block_tables, visible = inputs.block_tables, inputs.visible
    batch, n_heads, head_dim = q.shape
    per_block = keys.shape[1]
    width = block_tables.shape[1] * per_block
    scores = torch.empty(batch, width, dtype=torch.float32, device=q.device)
    if batch == 0 or width == 0:
        return scores
    form = paged_key_form(keys, key_scales, head_dim)
    dot, split_q = dot_dtypes(q, keys, form)
    coded = key_scales is not None
    scales_arg = key_scales if coded else keys
    weights, tables, visible = head_weights.float().contiguous(), block_tables.contiguous(), visible.contiguous()
    scale_block = head_dim // key_scales.shape[-1] if coded else head_dim
    if form == "fp4" and fp4_layout in ("words", "words_mma") and words_layout_fits(keys, key_scales, head_dim):
        chunk = chunk or choose_chunk(batch, width, q.device, WORDS_PROGRAMS_PER_SM, WORDS_MIN_TILES)
        if fp4_layout == "words_mma" and hopper_words_fits(inputs, chunk):
            hopper_words_launch(inputs, weights, tables, scores, chunk, **_mma_launch(words_launch))
            return scores
        launch = {"BLOCK_E": BLOCK_E, "NUM_STAGES": WORDS_STAGES, "num_warps": NUM_WARPS, **(words_launch or {})}
        words_scores_launch(inputs, weights, tables, scores, chunk, launch)
        return scores
    chunk = chunk or choose_chunk(batch, width, q.device)
    _split_scores_kernel[(triton.cdiv(width, chunk), batch)](
        q, weights, keys, scales_arg, tables, visible, scores, n_heads, width, chunk, q.stride(0), q.stride(1),
        weights.stride(0), keys.stride(0), keys.stride(1), scales_arg.stride(0) if coded else 0,
        scales_arg.stride(1) if coded else 0, tables.stride(0), scores.stride(0), head_dim**-0.5,
        PER_BLOCK=per_block, HEAD_DIM=head_dim, SCALE_BLOCK=scale_block,
        BLOCK_H=max(16, triton.next_power_of_2(n_heads)), BLOCK_E=BLOCK_E, FORM=FORMS[form],
        UE8M0=coded and key_scales.dtype == torch.uint8, ROW_SCALE=form == "fp8" and scale_block == head_dim,
        DOT=DOT_TYPES[dot], SPLIT_Q=split_q, PRECISION="ieee" if dot == torch.float32 else "tf32",
        BLOCK_D=triton.next_power_of_2(head_dim), NUM_STAGES=NUM_STAGES, num_warps=NUM_WARPS,
        FP4_HALVES=form == "fp4" and fp4_layout == "halves" and head_dim // 2 >= MIN_DOT_DEPTH,
    )  # fmt: skip
    return scores


def _mma_launch(words_launch: dict | None) -> dict:
    """The Gluon kernel's share of a words launch override: its pipeline depth and register cap (``maxnreg``; it
    always runs one warpgroup)."""
    names = {"NUM_STAGES": "num_stages", "maxnreg": "max_registers"}
    return {names[key]: value for key, value in (words_launch or {}).items() if key in names}


@register("index_scores_paged", "triton", devices=("cuda",), available=sparse_attention_triton_available,
          priority=10)  # fmt: skip
def index_scores_paged_triton(inputs: PagedIndexInputs) -> torch.Tensor:
    """Same contract as the reference; inputs the kernel does not take go to it."""
    if not serves(inputs.q, inputs.keys, inputs.key_scales):
        return index_scores_paged_reference(inputs)
    return paged_scores_launch(inputs)
