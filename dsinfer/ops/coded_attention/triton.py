"""Decode attention over V4.1's coded cache in Triton: V4's split-K decode kernel, decoding codes as tiles load.

With ``quantized_storage`` the torch path decoded every ring row of the batch and every chosen entry into new
model-dtype tensors (a table gather, casts, a multiply each), then attended over them. Here the split kernel of
:mod:`dsinfer.ops.sparse_attention.triton` walks the same tiles (window ring rows at ``position % W``, then the
chosen entries through the block table) but loads bytes: one FP8 e4m3 code per channel and the row's ue8m0
exponent bytes for the ring, two packed e2m1 codes per byte and the row's e4m3 scales for entries. A tile loads
one scale byte per block of channels ([BLOCK_N, HEAD_DIM // block]) and broadcasts it over the block's values
([BLOCK_N, HEAD_DIM // block, block]). e4m3 bytes (ring codes, entry scales) are decoded by the float8 cast
where Triton has it (sm_89 and later, and the interpreter; exact for every finite code), else by the cache
codec's arithmetic; an e2m1 nibble's fields are placed in a float16 bit pattern, ``2**-14`` times its value,
and the entry's scale carries the ``2**14`` back (exact: powers of two). Each element's value is its code's
value times its block's scale, formed in float32 (exact: a few significant bits times a scale) and rounded
once to the query dtype, exactly the rows the reference decodes; the online softmax (V4's tile step, or its
transpose), the sink and the combine of the splits are V4's. Results agree with the reference to the rounding of
V4's kernel (``tests/ops/test_coded_attention.py``).

Each tile feeds two products, ``q @ k^T`` and ``p @ k``. Handed the decoded values (the ``twice`` form of
:data:`DECODE`), Triton's layout passes rematerialise the whole decode (the code bytes' layout conversions, the
casts, the scale multiply) once in each product's operand layout, where warps hold repeated copies of the tile:
the sm_90 TTGIR has every decode op twice, the PTX 114 e4m3-pair conversions where one decode needs 34. The
``once`` form (the default) rounds the decoded tile to the query dtype and passes it through an identity
inline-PTX ``mov`` that is not pure, which those passes do not duplicate: the tile is decoded once, stored to
shared memory once and both products load their operands from that copy, as V4's kernel does with a loaded tile
(the ring's code bytes are now staged through shared memory by the software pipeliner too). The logits then read
the tile before q (``kv @ q^T``, keys first): with q read first, its operand loads were issued before the barrier
that guards the tile's copy, all at once, and spilled at 32 heads a program (so did a form that wrote q's shared
copy again in each tile, under the H200's Triton 3.6, and it was slower at 32 sequences). sm_90 builds at 64
heads x 512, bf16, with entries: ``once`` 106 / 138 registers a thread at 16 / 32 heads a program (V4's kernel:
108 / 138) and 66,560 / 83,968 bytes of shared memory, against 226 / 250 and 59,648 / 77,056 for ``twice``.

On the H200 (``benchmarks/attention_decode.py --coded --layers csa hca window --batch 1 32 --context 256``,
docs/perf.md, pass 10), graph replays at V4.1-Flash's shapes: one sequence 1.05-1.10x faster than
``twice`` (CSA 11.3 against 11.8 us), 32 sequences 1.14-1.31x (CSA 28.0 against 36.8 us).
"""

from __future__ import annotations

import torch

from dsinfer import envs
from dsinfer.ops.coded_attention.reference import CodedDecodeInputs, sparse_attention_decode_coded_reference
from dsinfer.ops.inline_ptx import inline_ptx_available
from dsinfer.ops.registry import register
from dsinfer.ops.sparse_attention.triton import LOG2E, DecodeConfig, choose_config
from dsinfer.ops.triton_support import tl, triton, triton_available

if triton is not None:
    from dsinfer.ops.cache_codec.triton import e4m3_value, ue8m0_value
    from dsinfer.ops.sparse_attention.triton import (
        _attend_tile,
        _step_origin,
        _step_rows,
        combine_splits,
        plan_splits,
        split_partials,
    )

    @triton.jit
    def e4m3_decode(byte, HARDWARE_FP8: tl.constexpr):
        """The float32 value of e4m3fn ``byte`` (uint8, not a NaN code): by the float8 cast (exact for every finite
        code, subnormals included), else by :func:`e4m3_value`'s arithmetic."""
        if HARDWARE_FP8:
            return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return e4m3_value(byte.to(tl.int32))

    @triton.jit
    def e2m1_scaled(nibble):
        """``2**-14`` times the value of e2m1 code ``nibble`` (uint8, low four bits; sign, 2-bit exponent, 1-bit
        mantissa), in float32: the nibble's fields are placed where float16 keeps its sign, the low exponent bits
        and the top mantissa bit (exponent bias 15 against e2m1's 1; the subnormal 0.5 becomes float16's
        subnormal ``2**-15``), exact in both formats."""
        bits = nibble.to(tl.int16)
        half = ((bits & 0x7) << 9) | ((bits & 0x8) << 12)
        return half.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _pinned(kv, PIN: tl.constexpr):
        """``kv`` unchanged; with ``PIN`` through an identity ``mov`` of inline PTX that is not pure. Triton's layout
        passes rematerialise pure elementwise chains in each consumer's layout but never duplicate this op, so the
        decode that produced ``kv`` stays one chain and its result goes to shared memory once."""
        if PIN:
            if kv.dtype == tl.float32:
                kv = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [kv], dtype=kv.dtype, is_pure=False, pack=1)
            else:  # two 16-bit values a register
                kv = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [kv], dtype=kv.dtype, is_pure=False, pack=2)
        return kv

    @triton.jit
    def _attend_tile_keys_first(q, kv, visible, running_max, running_sum, acc, scale_log2, PRECISION: tl.constexpr):
        """V4's ``_attend_tile`` with the logits transposed: ``kv @ q^T`` [BLOCK_N, BLOCK_H], the softmax along
        axis 0, then ``p @ kv`` with ``p`` the transposed probabilities. The first product reads the tile's shared
        copy before q's, so the barrier after the tile's store comes before every operand load of that product
        (with q first, its loads were issued ahead of the barrier, all at once, and spilled at 32 heads)."""
        logits = tl.dot(kv, tl.trans(q), input_precision=PRECISION) * scale_log2
        logits = tl.where(visible[:, None], logits, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(logits, axis=0))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(logits - new_max[None, :])
        running_sum = running_sum * rescale + tl.sum(probs, axis=0)
        acc = acc * rescale[:, None] + tl.dot(tl.trans(probs.to(kv.dtype)), kv, input_precision=PRECISION)
        return new_max, running_sum, acc

    @triton.jit
    def _attend_decoded(q, kv, visible, running_max, running_sum, acc, scale_log2, PRECISION: tl.constexpr,
                        DECODE: tl.constexpr, PIN: tl.constexpr):  # fmt: skip
        """A decoded tile (float32 ``kv`` [BLOCK_N, HEAD_DIM]) into the running softmax, in the form :data:`DECODE`
        names: ``twice``, V4's ``_attend_tile`` on it (each product rematerialises the decode in its own operand
        layout); ``once``, rounded to q's dtype and pinned (:func:`_pinned`), so both products read one shared
        copy, attended keys first."""
        if DECODE == "twice":
            new_max, running_sum, acc = _attend_tile(q, kv, visible, running_max, running_sum, acc, scale_log2,
                                                     PRECISION)  # fmt: skip
        else:
            kv = _pinned(kv.to(q.dtype), PIN)
            new_max, running_sum, acc = _attend_tile_keys_first(
                q, kv, visible, running_max, running_sum, acc, scale_log2, PRECISION
            )
        return new_max, running_sum, acc

    @triton.jit
    def _coded_split_kernel(
        q_ptr,
        window_ptr,
        window_scales_ptr,
        entries_ptr,
        entry_scales_ptr,
        slots_ptr,
        positions_ptr,
        window_from_ptr,
        tables_ptr,
        indices_ptr,
        step_codes_ptr,
        step_scales_ptr,
        step_starts_ptr,
        step_first_ptr,
        sink_ptr,
        out_ptr,
        part_out_ptr,
        part_max_ptr,
        part_sum_ptr,
        n_heads,
        n_indices,
        tiles_per_split,
        n_tiles,
        stride_qb,
        stride_qh,
        stride_ws,
        stride_ww,
        stride_vs,
        stride_vw,
        stride_eb,
        stride_ep,
        stride_fb,
        stride_fp,
        stride_sc,
        stride_sv,
        stride_tb,
        stride_ib,
        stride_ob,
        stride_oh,
        scale_log2,
        WINDOW: tl.constexpr,
        WINDOW_TILES: tl.constexpr,
        PER_BLOCK: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        WINDOW_BLOCK: tl.constexpr,  # channels per ue8m0 exponent of a ring row
        ENTRY_BLOCK: tl.constexpr,  # channels per e4m3 scale of an entry
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLITS: tl.constexpr,
        HAS_ENTRIES: tl.constexpr,
        HAS_STEP: tl.constexpr,  # a verify step's rows come from step_codes_ptr (from the query's step start on)
        PRECISION: tl.constexpr,
        HARDWARE_FP8: tl.constexpr,  # e4m3 bytes decoded by the float8 cast (sm_89+, the interpreter)
        DECODE: tl.constexpr,  # "once" or "twice" (the module's DECODE)
        PIN: tl.constexpr,  # the once form's inline-PTX pin (not in the interpreter, which has no inline asm)
    ):
        seq = tl.program_id(0)
        group = tl.program_id(1)
        split = tl.program_id(2)
        heads = group * BLOCK_H + tl.arange(0, BLOCK_H)
        head_ok = heads < n_heads
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None],
                    other=0.0)  # fmt: skip
        position = tl.load(positions_ptr + seq)
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        oldest = tl.maximum(tl.maximum(position - WINDOW + 1, tl.load(window_from_ptr + seq)), 0)
        ring = window_ptr + slot * stride_ws
        ring_scales = window_scales_ptr + slot * stride_vs
        WINDOW_BLOCKS: tl.constexpr = HEAD_DIM // WINDOW_BLOCK
        window_blocks = tl.arange(0, WINDOW_BLOCKS)
        step_start, step_first = _step_origin(step_starts_ptr, step_first_ptr, seq, position, HAS_STEP)

        running_max = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        running_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
        first = split * tiles_per_split
        last = tl.minimum(first + tiles_per_split, n_tiles)
        for tile in range(first, tl.minimum(last, WINDOW_TILES)):
            key = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            key_position = position - WINDOW + 1 + key
            visible = (key < WINDOW) & (key_position >= oldest)
            row = key_position % WINDOW
            row = tl.where(row < 0, row + WINDOW, row).to(tl.int64)
            codes = ring + row[:, None] * stride_ww + dims[None, :]
            exponents = ring_scales + row[:, None] * stride_vw + window_blocks[None, :]
            if HAS_STEP:  # the step's own positions from its rows, the earlier ones from the ring
                from_step, step_row = _step_rows(key_position, step_start, step_first)
                codes = tl.where(from_step[:, None], step_codes_ptr + step_row[:, None] * stride_sc + dims[None, :],
                                 codes)  # fmt: skip
                exponents = tl.where(from_step[:, None],
                                     step_scales_ptr + step_row[:, None] * stride_sv + window_blocks[None, :],
                                     exponents)  # fmt: skip
            # one exponent per block of WINDOW_BLOCK channels, broadcast over the block's codes
            code = tl.load(codes, mask=visible[:, None], other=0)
            exponent = tl.load(exponents, mask=visible[:, None], other=127)
            value = tl.reshape(e4m3_decode(code, HARDWARE_FP8), [BLOCK_N, WINDOW_BLOCKS, WINDOW_BLOCK])
            value = value * ue8m0_value(exponent.to(tl.int32))[:, :, None]
            kv = tl.reshape(value, [BLOCK_N, HEAD_DIM])
            running_max, running_sum, acc = _attend_decoded(
                q, kv, visible, running_max, running_sum, acc, scale_log2, PRECISION, DECODE, PIN
            )
        if HAS_ENTRIES:
            ENTRY_BLOCKS: tl.constexpr = HEAD_DIM // ENTRY_BLOCK
            PAIRS: tl.constexpr = ENTRY_BLOCK // 2  # packed bytes of a block
            entry_blocks = tl.arange(0, ENTRY_BLOCKS)
            pairs = entry_blocks[:, None] * PAIRS + tl.arange(0, PAIRS)[None, :]
            for tile in range(tl.maximum(first, WINDOW_TILES), last):
                entry = (tile - WINDOW_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
                index = tl.load(indices_ptr + seq * stride_ib + entry, mask=entry < n_indices, other=-1)
                visible = index >= 0
                block = tl.load(tables_ptr + seq * stride_tb + index // PER_BLOCK, mask=visible, other=0).to(tl.int64)
                in_block = (index % PER_BLOCK).to(tl.int64)
                packed = tl.load(entries_ptr + (block * stride_eb + in_block * stride_ep)[:, None, None]
                                 + pairs[None, :, :], mask=visible[:, None, None], other=0)  # fmt: skip
                scale_byte = tl.load(entry_scales_ptr + (block * stride_fb + in_block * stride_fp)[:, None]
                                     + entry_blocks[None, :], mask=visible[:, None], other=0)  # fmt: skip
                scale = e4m3_decode(scale_byte, HARDWARE_FP8) * 16384.0  # the 2**14 e2m1_scaled leaves out
                value = tl.join(e2m1_scaled(packed & 0xF), e2m1_scaled(packed >> 4))  # channel 2j: low nibble
                kv = tl.reshape(value * scale[:, :, None, None], [BLOCK_N, HEAD_DIM])
                running_max, running_sum, acc = _attend_decoded(
                    q, kv, visible, running_max, running_sum, acc, scale_log2, PRECISION, DECODE, PIN
                )

        out_mask = head_ok[:, None]
        if SPLITS == 1:
            sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            top = tl.maximum(running_max, sink)
            weight = tl.exp2(running_max - top)
            total = running_sum * weight + tl.exp2(sink - top)
            result = acc * (weight / total)[:, None]
            tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                     result.to(out_ptr.dtype.element_ty), mask=out_mask)  # fmt: skip
        else:
            row_id = (seq * SPLITS + split) * n_heads + heads  # partials [B, SPLITS, H, (D)]
            tl.store(part_max_ptr + row_id, running_max, mask=head_ok)
            tl.store(part_sum_ptr + row_id, running_sum, mask=head_ok)
            tl.store(part_out_ptr + row_id.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)


DECODES = ("once", "twice")
DECODE = "once"
"""How the kernel turns a tile's codes into the K=V tile both products read (one of :data:`DECODES`): ``once``
decodes it once, rounds it to the query dtype and stores it to shared memory, where both products read it, the
logits computed keys first (``kv @ q^T``); ``twice`` hands V4's tile step the decoded float32 values, and
Triton's layout passes rematerialise the whole decode once per product. The environment variable
``DSINFER_CODED_ATTENTION_DECODE`` overrides it at each launch (``benchmarks/attention_decode.py --coded`` times
every form in one run)."""


def decode_form() -> str:
    """The form launches take: ``DSINFER_CODED_ATTENTION_DECODE`` where set, else :data:`DECODE`."""
    return envs.CODED_ATTENTION_DECODE.get() or DECODE


def fp8_cast_available(device: torch.device) -> bool:
    """Whether the kernel decodes e4m3 bytes by the float8 cast: Triton has it from sm_89 (and in the interpreter,
    which runs on the CPU); older GPUs take the arithmetic."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def serves(q, window_codes, window_scales, entry_codes, entry_scales, indices) -> bool:
    """Whether the kernel takes these inputs (else the reference runs)."""
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or q.stride(-1) != 1:
        return False
    head_dim = q.shape[-1]
    if head_dim < 32 or head_dim & (head_dim - 1) or window_codes.shape[-1] != head_dim:
        return False
    if window_codes.stride(-1) != 1 or window_scales.stride(-1) != 1 or head_dim % window_scales.shape[-1]:
        return False
    if entry_codes is not None and indices is not None:
        if entry_codes.shape[-1] * 2 != head_dim or entry_codes.stride(-1) != 1 or entry_scales.stride(-1) != 1:
            return False
        if head_dim % entry_scales.shape[-1] or head_dim == entry_scales.shape[-1] or indices.dim() != 2:
            return False
    return True


def sparse_attention_decode_coded_launch(
    inputs: CodedDecodeInputs,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    hardware_fp8: bool | None = None,
    decode: str | None = None,
) -> torch.Tensor:
    """The kernels, no fallback (``num_splits`` None: from the shapes and the SM count, as V4's; ``config`` None:
    V4's :func:`choose_config`, which also serves this kernel best on the H200: one sequence at 256 context, 48.6
    us with entries and 16.8 us over the window alone at 16 heads a program and 8 splits, against 70.9 and 46.6 us
    at 32 heads and the old split rule; 32 sequences stay best at 32 heads a program, 171 us; tiles of 16 keys
    did worse or drifted further from the reference; these times are the ``twice`` form's). ``hardware_fp8``
    None: :func:`fp8_cast_available`. ``decode`` (one of :data:`DECODES`) None: :func:`decode_form`."""
    q, entry_codes, indices = inputs.q, inputs.entry_codes, inputs.indices
    batch, n_heads, head_dim = q.shape
    config = config or choose_config(n_heads, q.dtype, head_dim, batch)
    size = inputs.window_codes.shape[1]
    has_entries = entry_codes is not None and indices is not None and indices.shape[1] > 0
    n_indices = indices.shape[1] if has_entries else 0
    fp8_cast = fp8_cast_available(q.device) if hardware_fp8 is None else hardware_fp8
    decode = decode or decode_form()
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")
    out = torch.empty_like(q)
    if batch == 0:
        return out
    plan = plan_splits(q, size, n_indices, config, num_splits)
    window = inputs.window_codes.view(torch.uint8)
    window_exponents = inputs.window_scales.view(torch.uint8)
    slots, positions, window_from, sink = (t.contiguous() for t in (inputs.slots, inputs.positions,
                                                                    inputs.window_from, inputs.sink))  # fmt: skip
    if has_entries:
        entries, entry_bytes = entry_codes.view(torch.uint8), inputs.entry_scales.view(torch.uint8)
        indices, tables = indices.contiguous(), inputs.block_tables.contiguous()
        per_block, entry_block = entries.shape[1], head_dim // entry_bytes.shape[-1]
    else:  # window only: the entry pointers are never read
        entries, entry_bytes, indices, tables, per_block, entry_block = window, window_exponents, slots, slots, 1, 16
    part_out, part_max, part_sum = split_partials(out, plan.splits)
    step = inputs.step
    if step is not None:  # the step's rows as codes and exponent bytes, like the ring's
        step_codes, step_exponents = step.rows.view(torch.uint8), step.scales.view(torch.uint8)
        step_starts, step_first = step.starts.contiguous(), step.first_rows.contiguous()
    else:  # the step pointers are never read
        step_codes, step_exponents, step_starts, step_first = window, window_exponents, slots, slots
    _coded_split_kernel[(batch, plan.head_groups, plan.splits)](
        q, window, window_exponents, entries, entry_bytes, slots, positions, window_from, tables, indices,
        step_codes, step_exponents, step_starts, step_first, sink,
        out, part_out, part_max, part_sum, n_heads, n_indices, plan.tiles_per_split, plan.n_tiles,
        q.stride(0), q.stride(1), window.stride(0), window.stride(1), window_exponents.stride(0),
        window_exponents.stride(1), entries.stride(0) if has_entries else 0, entries.stride(1) if has_entries else 0,
        entry_bytes.stride(0) if has_entries else 0, entry_bytes.stride(1) if has_entries else 0,
        step_codes.stride(0), step_exponents.stride(0),
        tables.stride(0), indices.stride(0), out.stride(0), out.stride(1), inputs.softmax_scale * LOG2E,
        WINDOW=size, WINDOW_TILES=plan.window_tiles, PER_BLOCK=per_block, HEAD_DIM=head_dim,
        WINDOW_BLOCK=head_dim // window_exponents.shape[-1], ENTRY_BLOCK=entry_block, BLOCK_H=config.block_h,
        BLOCK_N=config.block_n, SPLITS=plan.splits, HAS_ENTRIES=has_entries, HAS_STEP=step is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HARDWARE_FP8=fp8_cast, DECODE=decode,
        PIN=inline_ptx_available(q.device),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if plan.splits > 1:
        combine_splits(part_out, part_max, part_sum, sink, out)
    return out


@register(
    "sparse_attention_decode_coded",
    "triton",
    devices=("cuda",),
    available=triton_available,
    priority=10,
)
def sparse_attention_decode_coded_triton(inputs: CodedDecodeInputs) -> torch.Tensor:
    """Same contract as the reference; inputs the kernel does not take go to it."""
    coded = (inputs.window_codes, inputs.window_scales, inputs.entry_codes, inputs.entry_scales)
    if not serves(inputs.q, *coded, inputs.indices):
        return sparse_attention_decode_coded_reference(inputs)
    return sparse_attention_decode_coded_launch(inputs)
