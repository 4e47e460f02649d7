"""A compressor's decode step in one Triton kernel: ``compressor_decode`` and ``compressor_decode_store``.

The torch reference spends about forty kernels per compressor and decode step: the slot bias, the pending-row
writes, gathers of every sequence's whole window, the overlap's masks and concatenations, a softmax over the
window's slots (a slow "spatial" softmax for HCA's 128 slots), the weighted sum, the norm, and for V4 the RoPE
angles' use, the entry's block lookup and its write. At one request they are tiny, so their launches, not their
bytes, are the cost. Here one program per sequence writes the token's row into its slot's pending window and,
only when the token completes the window, pools it (three passes over the slots: the max, the softmax
denominator, the weighted sum, so each weight is rounded to the values' dtype exactly where the reference rounds
it), normalises, and either returns the entry or (the ``_store`` op) rotates and writes it to its cache block.
A token that completes nothing writes only its pending row: its latent row stays zero and nothing goes to the
trash block (the reference's rows there are never read).

Reads of the pending window follow the token's own write in the same program: a CTA barrier orders them, as it
orders the overlap's reads of the previous window before that window is overwritten. The kernel is compiled
without fused multiply-adds, so the RoPE rotation rounds as the reference does; the softmax's ``exp`` and the
order of the float32 sums may differ from torch's in the last bit.
"""

from __future__ import annotations

import torch

from dsinfer.ops.compressor.reference import (
    CompressorDecodeInputs,
    CompressorStoreInputs,
    compressor_decode_reference,
    compressor_decode_store_reference,
)
from dsinfer.ops.registry import register
from dsinfer.ops.triton_support import tl, triton, triton_available

VALUE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


if triton is not None:

    @triton.jit
    def _chunk(
        pending_ptr,
        previous_ptr,
        slot,
        chunk: tl.constexpr,
        stride_ps,
        stride_pr,
        RATIO: tl.constexpr,
        DIM: tl.constexpr,
        OVERLAP: tl.constexpr,
        SLOTS_BLOCK: tl.constexpr,
        HALF_BLOCK: tl.constexpr,
    ):
        """Pointers [SLOTS_BLOCK, HALF_BLOCK, 2] of one chunk of the window's pooled slots, and their mask.

        Overlapping: slots [0, RATIO) are the previous window's first channel half, [RATIO, 2 RATIO) this
        window's second half; otherwise the RATIO slots of this window."""
        s = tl.arange(0, SLOTS_BLOCK)[:, None, None]
        j = tl.arange(0, HALF_BLOCK)[None, :, None]
        k = tl.arange(0, 2)[None, None, :]
        channel = 2 * j + k
        mask = (channel < DIM) & (s < SLOTS_BLOCK)
        first_slot: tl.constexpr = chunk * SLOTS_BLOCK
        if OVERLAP and first_slot < RATIO:
            base = previous_ptr + slot * stride_ps + (first_slot + s) * stride_pr + channel
        elif OVERLAP:
            base = pending_ptr + slot * stride_ps + (first_slot - RATIO + s) * stride_pr + DIM + channel
        else:
            base = pending_ptr + slot * stride_ps + (first_slot + s) * stride_pr + channel
        return base, mask

    @triton.jit
    def _compressor_decode_kernel(
        values_ptr,
        gates_ptr,
        bias_ptr,
        positions_ptr,
        slots_ptr,
        window_from_ptr,
        pending_v_ptr,
        pending_g_ptr,
        previous_v_ptr,
        previous_g_ptr,
        norm_ptr,
        eps,
        latents_ptr,
        entry_ptr,
        complete_ptr,
        cos_ptr,
        sin_ptr,
        entries_ptr,
        tables_ptr,
        stride_vb,
        stride_gb,
        stride_ps,
        stride_pr,
        stride_cb,
        stride_sb,
        stride_eb,
        stride_er,
        stride_tb,
        max_blocks,
        per_block,
        RATIO: tl.constexpr,
        DIM: tl.constexpr,
        ROPE_HALF: tl.constexpr,  # rope_dim // 2 pairs at the end of the channels (0: no RoPE)
        OVERLAP: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        STORE: tl.constexpr,
        WIDTH_BLOCK: tl.constexpr,
        HALF_BLOCK: tl.constexpr,
        SLOTS_BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        position = tl.load(positions_ptr + b)
        slot = tl.load(slots_ptr + b)
        offset = position % RATIO
        first = position - offset
        complete = offset == RATIO - 1
        width: tl.constexpr = 2 * DIM if OVERLAP else DIM
        value_dtype = pending_v_ptr.dtype.element_ty

        # The token's row of its pending window (the slot bias added in the gates' dtype, as the reference does).
        c = tl.arange(0, WIDTH_BLOCK)
        row_ok = c < width
        value = tl.load(values_ptr + b * stride_vb + c, mask=row_ok)
        gate = tl.load(gates_ptr + b * stride_gb + c, mask=row_ok)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offset * width + c, mask=row_ok).to(gate.dtype)
            gate = (gate.to(tl.float32) + bias.to(tl.float32)).to(gate.dtype)
        row = slot * stride_ps + offset * stride_pr + c
        tl.store(pending_v_ptr + row, value.to(value_dtype), mask=row_ok)
        tl.store(pending_g_ptr + row, gate.to(pending_g_ptr.dtype.element_ty), mask=row_ok)
        tl.debug_barrier()  # the window's reads below see this row

        j = tl.arange(0, HALF_BLOCK)[:, None]
        k = tl.arange(0, 2)[None, :]
        channel = 2 * j + k  # [HALF_BLOCK, 2]: the channel pairs RoPE rotates together
        channel_ok = channel < DIM
        if not STORE:
            tl.store(entry_ptr + b, first // RATIO)
            tl.store(complete_ptr + b, complete)
        if complete:
            chunks: tl.constexpr = (2 * RATIO if OVERLAP else RATIO) // SLOTS_BLOCK
            has_previous = (first >= RATIO) & (first - RATIO >= tl.load(window_from_ptr + b))
            top = tl.full([HALF_BLOCK, 2], float("-inf"), tl.float32)
            for q in tl.static_range(chunks):
                gate_at, mask = _chunk(pending_g_ptr, previous_g_ptr, slot, q, stride_ps, stride_pr,
                                       RATIO, DIM, OVERLAP, SLOTS_BLOCK, HALF_BLOCK)  # fmt: skip
                g = tl.load(gate_at, mask=mask, other=float("-inf")).to(tl.float32)
                if OVERLAP and q * SLOTS_BLOCK < RATIO:
                    g = tl.where(has_previous, g, float("-inf"))
                top = tl.maximum(top, tl.max(g, axis=0))
            top = tl.where(channel_ok, top, 0.0)
            total = tl.zeros([HALF_BLOCK, 2], tl.float32)
            for q in tl.static_range(chunks):
                gate_at, mask = _chunk(pending_g_ptr, previous_g_ptr, slot, q, stride_ps, stride_pr,
                                       RATIO, DIM, OVERLAP, SLOTS_BLOCK, HALF_BLOCK)  # fmt: skip
                g = tl.load(gate_at, mask=mask, other=float("-inf")).to(tl.float32)
                if OVERLAP and q * SLOTS_BLOCK < RATIO:
                    g = tl.where(has_previous, g, float("-inf"))
                total += tl.sum(tl.exp(g - top[None, :, :]), axis=0)
            total = tl.where(channel_ok, total, 1.0)
            pooled = tl.zeros([HALF_BLOCK, 2], tl.float32)
            for q in tl.static_range(chunks):
                gate_at, mask = _chunk(pending_g_ptr, previous_g_ptr, slot, q, stride_ps, stride_pr,
                                       RATIO, DIM, OVERLAP, SLOTS_BLOCK, HALF_BLOCK)  # fmt: skip
                value_at, _ = _chunk(pending_v_ptr, previous_v_ptr, slot, q, stride_ps, stride_pr,
                                     RATIO, DIM, OVERLAP, SLOTS_BLOCK, HALF_BLOCK)  # fmt: skip
                g = tl.load(gate_at, mask=mask, other=float("-inf")).to(tl.float32)
                v = tl.load(value_at, mask=mask, other=0.0)
                if OVERLAP and q * SLOTS_BLOCK < RATIO:
                    g = tl.where(has_previous, g, float("-inf"))
                    v = tl.where(has_previous, v, 0.0).to(value_dtype)
                weight = (tl.exp(g - top[None, :, :]) / total[None, :, :]).to(value_dtype)
                product = (v.to(tl.float32) * weight.to(tl.float32)).to(value_dtype)  # rounded as torch does
                pooled += tl.sum(product.to(tl.float32), axis=0)
            out_dtype = latents_ptr.dtype.element_ty
            pooled = pooled.to(value_dtype).to(out_dtype).to(tl.float32)
            pooled = tl.where(channel_ok, pooled, 0.0)
            scale = 1.0 / tl.sqrt_rn(tl.sum(tl.sum(pooled * pooled, axis=1), axis=0) / DIM + eps)
            norm = tl.load(norm_ptr + channel, mask=channel_ok, other=0.0).to(tl.float32)
            latent = (norm * (pooled * scale)).to(out_dtype)
            if STORE:
                even, odd = tl.split(latent.to(tl.float32))
                pair = tl.arange(0, HALF_BLOCK)
                rope_pair = pair - (DIM // 2 - ROPE_HALF)
                is_rope = (rope_pair >= 0) & (pair < DIM // 2)
                cos = tl.load(cos_ptr + b * stride_cb + rope_pair, mask=is_rope, other=1.0)
                sin = tl.load(sin_ptr + b * stride_sb + rope_pair, mask=is_rope, other=0.0)
                rotated = tl.join(even * cos - odd * sin, even * sin + odd * cos).to(out_dtype)
                latent = tl.where(is_rope[:, None], rotated, latent)
                entry = first // RATIO
                column = tl.minimum(entry // per_block, max_blocks - 1)
                block = tl.load(tables_ptr + b * stride_tb + column)
                destination = entries_ptr + block * stride_eb + (entry % per_block) * stride_er + channel
                tl.store(destination, latent.to(entries_ptr.dtype.element_ty), mask=channel_ok)
            else:
                tl.store(latents_ptr + b * DIM + channel, latent, mask=channel_ok)
            if OVERLAP:  # this window becomes the slot's previous one, after every read of the old one
                tl.debug_barrier()
                for r in tl.static_range(RATIO):
                    at = slot * stride_ps + r * stride_pr + c
                    tl.store(previous_v_ptr + at, tl.load(pending_v_ptr + at, mask=row_ok), mask=row_ok)
                    tl.store(previous_g_ptr + at, tl.load(pending_g_ptr + at, mask=row_ok), mask=row_ok)
        elif not STORE:
            tl.store(latents_ptr + b * DIM + channel, tl.zeros([HALF_BLOCK, 2], latents_ptr.dtype.element_ty),
                     mask=channel_ok)  # fmt: skip


def serves(inputs: CompressorDecodeInputs) -> bool:
    """Whether the kernel takes these inputs (else the backends run the reference)."""
    values, gates, slot_bias, pending_values = inputs.values, inputs.gates, inputs.slot_bias, inputs.pending_values
    previous_values, previous_gates = inputs.previous_values, inputs.previous_gates
    states = [pending_values, inputs.pending_gates]
    if previous_values is not None:
        states += [previous_values, previous_gates]
    if previous_values is None and previous_gates is not None:
        return False
    if values.dim() != 2 or values.dtype not in VALUE_DTYPES or values.requires_grad or gates.requires_grad:
        return False
    if gates.shape != values.shape or values.stride(1) != 1 or gates.stride(1) != 1:
        return False
    if any(s.shape != pending_values.shape or s.stride() != pending_values.stride() for s in states):
        return False
    if pending_values.stride(2) != 1 or pending_values.shape[2] != values.shape[1]:
        return False
    ratio, width = pending_values.shape[1], pending_values.shape[2]
    if ratio < 2 or ratio & (ratio - 1) or (previous_values is not None and width % 2):
        return False
    if slot_bias is not None and (slot_bias.shape != (ratio, width) or not slot_bias.is_contiguous()):
        return False
    return all(t.device == values.device for t in states + [gates])


def _slots_block(ratio: int, dim: int) -> int:
    """Slots per chunk: a power of two dividing ``ratio``, about 8K elements of the window at a time."""
    block = 1
    while block * 2 <= min(ratio, 8192 // max(dim, 1)):
        block *= 2
    return block


def _store_operands(inputs: CompressorDecodeInputs, latents: torch.Tensor) -> tuple:
    """(cos, sin, entries, tables, rope_half, cos_stride, sin_stride, entry_strides, table_stride, max_blocks,
    per_block) of the storing variant (``inputs`` a :class:`CompressorStoreInputs`), else placeholders never read."""
    if not isinstance(inputs, CompressorStoreInputs):
        return latents, latents, latents, latents, 0, 0, 0, (0, 0), 0, 1, 1
    cos, sin, entries, tables = inputs.cos, inputs.sin, inputs.entries, inputs.block_tables
    entry_strides = (entries.stride(0), entries.stride(1))
    return (cos, sin, entries, tables, cos.shape[-1], cos.stride(0), sin.stride(0), entry_strides, tables.stride(0),
            tables.shape[1], entries.shape[1])  # fmt: skip


def _launch(inputs: CompressorDecodeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the kernel; a :class:`CompressorStoreInputs` runs the storing variant."""
    values, gates, slot_bias, pending_values = inputs.values, inputs.gates, inputs.slot_bias, inputs.pending_values
    batch, width = values.shape
    ratio = pending_values.shape[1]
    overlap = inputs.previous_values is not None
    dim = width // 2 if overlap else width
    device = values.device
    latents = torch.empty(batch, dim, dtype=inputs.dtype, device=device)
    entry = torch.empty(batch, dtype=torch.int64, device=device)
    complete = torch.empty(batch, dtype=torch.bool, device=device)
    if batch == 0:
        return latents, entry, complete
    previous_v = inputs.previous_values if overlap else pending_values  # unused without overlap
    previous_g = inputs.previous_gates if overlap else inputs.pending_gates
    store = isinstance(inputs, CompressorStoreInputs)
    cos, sin, entries, tables, rope_half, cos_stride, sin_stride, entry_strides, table_stride, max_blocks, \
        per_block = _store_operands(inputs, latents)  # fmt: skip
    norm = inputs.norm_weight.contiguous()
    _compressor_decode_kernel[(batch,)](
        values, gates, slot_bias if slot_bias is not None else values, inputs.positions.contiguous(),
        inputs.slots.contiguous(), inputs.window_from.contiguous(), pending_values, inputs.pending_gates, previous_v,
        previous_g, norm, float(inputs.eps),
        latents, entry, complete, cos, sin, entries, tables,
        values.stride(0), gates.stride(0), pending_values.stride(0), pending_values.stride(1), cos_stride,
        sin_stride, entry_strides[0], entry_strides[1], table_stride, max_blocks, per_block,
        RATIO=ratio, DIM=dim, ROPE_HALF=rope_half, OVERLAP=overlap, HAS_BIAS=slot_bias is not None,
        STORE=store, WIDTH_BLOCK=triton.next_power_of_2(width),
        HALF_BLOCK=triton.next_power_of_2(max(1, (dim + 1) // 2)), SLOTS_BLOCK=_slots_block(ratio, dim),
        num_warps=8 if dim >= 256 else 4, enable_fp_fusion=False,
    )  # fmt: skip
    return latents, entry, complete


@register("compressor_decode", "triton", devices=("cuda",), available=triton_available, priority=10)
def compressor_decode_triton(inputs: CompressorDecodeInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``compressor_decode_reference`` (the latent rows of incomplete windows are zero)."""
    if not serves(inputs):
        return compressor_decode_reference(inputs)
    return _launch(inputs)


@register("compressor_decode_store", "triton", devices=("cuda",), available=triton_available, priority=10)
def compressor_decode_store_triton(inputs: CompressorStoreInputs) -> None:
    """Same contract as ``compressor_decode_store_reference``; incomplete windows write nothing (not the trash)."""
    cos, sin, entries = inputs.cos, inputs.sin, inputs.entries
    angles_ok = cos.dtype == sin.dtype == torch.float32 and cos.dim() == 2 and cos.shape == sin.shape
    angles_ok = angles_ok and cos.shape[0] == inputs.values.shape[0] and cos.stride(1) == sin.stride(1) == 1
    entries_ok = entries.dim() == 3 and entries.stride(2) == 1 and entries.shape[2] >= 2 * cos.shape[-1]
    if not (serves(inputs) and angles_ok and entries_ok and inputs.block_tables.stride(1) == 1):
        return compressor_decode_store_reference(inputs)
    _launch(inputs)
