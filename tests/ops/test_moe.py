"""routed_moe: the reference against the model's current MoE math, every backend against the reference."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import dsinfer.ops.moe.triton as moe_triton
from dsinfer.layers.moe import Expert
from dsinfer.ops import registry
from dsinfer.ops.moe import (
    ExpertWeights,
    align_slots,
    dequantize_expert,
    max_aligned_blocks,
    routed_moe_reference,
    sort_slots,
    stack_experts,
)
from dsinfer.ops.moe.grouped_mm import routed_moe_grouped_mm
from dsinfer.ops.quant import dequantize_fp4, quantize_fp4

LIMIT = 1.5  # small enough that the clamps bite on these random weights


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fp4_weights(experts: int, hidden: int, inter: int, seed: int) -> ExpertWeights:
    """Random experts quantised the checkpoint's way (scales vary across groups, so dequantisation matters)."""
    gen = _generator(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * torch.rand(experts, 2 * inter, 1, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    w13_codes, w13_scale = quantize_fp4(w13 * 0.3)
    w2_codes, w2_scale = quantize_fp4(w2)
    as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731
    return ExpertWeights(as_bytes(w13_codes), as_bytes(w13_scale), as_bytes(w2_codes), as_bytes(w2_scale), inter, True)


def _dense_weights(experts: int, hidden: int, inter: int, seed: int, dtype=torch.float32) -> ExpertWeights:
    gen = _generator(seed)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.2).to(dtype)
    return ExpertWeights(w13, None, w2, None, inter, False)


def _routing(tokens: int, top_k: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (like top-k), expert 1 never picked (a zero-token expert in every case)."""
    gen = _generator(seed)
    scores = torch.rand(tokens, experts, generator=gen)
    scores[:, 1] = -1.0
    ids = torch.topk(scores, top_k, dim=-1, sorted=False).indices
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return ids, weights


def _current_moe(x, weights: ExpertWeights, ids, mix) -> torch.Tensor:
    """The model's MoE math before the op, over a ModuleList of ``Expert`` holding the dequantised weights."""
    inter = weights.intermediate_size
    experts = nn.ModuleList()
    for e in range(weights.num_experts):
        w13, w2 = dequantize_expert(weights, e, x.dtype)
        expert = Expert(weights.hidden_size, inter, LIMIT).to(x.dtype)
        with torch.no_grad():
            expert.w1.weight.copy_(w13[:inter])
            expert.w3.weight.copy_(w13[inter:])
            expert.w2.weight.copy_(w2)
        experts.append(expert)
    # The per-expert loop the model ran before routed_moe existed, kept literally as the oracle.
    with torch.no_grad():
        routed = torch.zeros_like(x)
        flat_experts = ids.flatten()
        order = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=weights.num_experts).tolist()
        token_of_slot = order // ids.shape[1]
        start = 0
        for expert_id, count in enumerate(counts):
            if count == 0:
                continue
            slots = order[start : start + count]
            tokens = token_of_slot[start : start + count]
            start += count
            out = experts[expert_id](x[tokens]) * mix.flatten()[slots, None].to(x.dtype)
            routed.index_add_(0, tokens, out)
        return routed


@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(1, 1, 4), (5, 2, 8), (37, 6, 8)])
def test_reference_is_the_current_moe_math_bit_for_bit(tokens, top_k, experts):
    weights = _fp4_weights(experts, 64, 32, seed=tokens)
    ids, mix = _routing(tokens, top_k, experts, seed=tokens + 1)
    x = torch.randn(tokens, 64, generator=_generator(tokens + 2))
    out = routed_moe_reference(x, weights, ids, mix, LIMIT)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert torch.equal(out, _current_moe(x, weights, ids, mix))
    # The dequantiser it uses is the checkpoint's: w13 rows are w1 then w3, nibble order low-first.
    w13, _ = dequantize_expert(weights, 2, torch.float32)
    e8m0 = torch.float8_e8m0fnu
    assert torch.equal(w13, dequantize_fp4(weights.w13[2], weights.w13_scale[2].view(e8m0)))


def test_routing_layouts_cover_every_slot_once():
    for tokens, top_k, experts, block_m in [
        (1, 1, 4, 16),
        (5, 2, 8, 16),
        (37, 6, 8, 16),
        (37, 6, 8, 64),
        (0, 2, 4, 16),
    ]:
        ids, _ = _routing(tokens, top_k, experts, seed=3)
        grouped = sort_slots(ids, experts)
        num_slots = tokens * top_k
        assert torch.equal(grouped.slots.sort().values, torch.arange(num_slots))
        assert torch.equal(grouped.experts, ids.reshape(-1)[grouped.slots])
        assert torch.equal(grouped.counts, torch.bincount(ids.reshape(-1), minlength=experts))
        assert grouped.counts[1] == 0 and grouped.offsets[-1] == num_slots
        aligned = align_slots(grouped, block_m)
        assert aligned.max_blocks == max_aligned_blocks(num_slots, experts, block_m)
        live = aligned.slot_ids[aligned.slot_ids < num_slots]
        assert torch.equal(live.sort().values, torch.arange(num_slots))  # every slot exactly once
        assert bool((aligned.slot_ids <= num_slots).all())  # the rest is the pad marker
        need = int(((grouped.counts + block_m - 1) // block_m).sum())
        assert int(aligned.num_blocks) == need <= aligned.max_blocks
        blocks = aligned.slot_ids.view(-1, block_m)
        for b in range(aligned.max_blocks):
            row = blocks[b]
            if b >= need:
                assert aligned.block_expert[b] == -1 and bool((row == num_slots).all())
                continue
            real = row[row < num_slots]
            assert real.numel() > 0  # a live block holds at least one slot, all of its own expert
            assert bool((ids.reshape(-1)[real] == aligned.block_expert[b]).all())
            assert torch.equal(real, real.sort().values)  # stable: token order inside an expert
            assert bool((row[real.numel() :] == num_slots).all())  # padding only at the block's end
    assert max_aligned_blocks(6, 256, 16) == 6 and max_aligned_blocks(24576, 256, 64) == (24576 + 256 * 63) // 64


def _interpret(monkeypatch, dot_scaled: bool = True) -> None:
    """Run the module's kernels in Triton's interpreter, with its bf16 arithmetic made the hardware's.

    Triton 3.9's interpreter keeps bf16 values as their raw uint16 bits and (1) multiplies those bits as
    integers in ``tl.dot``, (2) converts float32 to bf16 by truncation, (3) passes bf16 operands of
    ``tl.dot_scaled`` through fp16. Here bf16 dot operands are widened to the float32 values they stand for
    (bf16 x bf16 products are exact in the fp32 accumulator, as on the GPU; e2m1 times a power-of-two scale is
    exact in bf16) and float32 -> bf16 rounds to nearest even, as the compiled ``.to(tl.bfloat16)`` does."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    import numpy as np
    import triton
    import triton.language as tl

    for name in moe_triton.JIT_FUNCTIONS:
        monkeypatch.setattr(moe_triton, name, interpreter.InterpretedFunction(getattr(moe_triton, name).fn))
    from dsinfer.ops.moe import combine_triton

    monkeypatch.setattr(
        combine_triton, "_sum_slots_kernel", interpreter.InterpretedFunction(combine_triton._sum_slots_kernel.fn)
    )
    builder = interpreter.interpreter_builder
    create_dot = builder.create_dot

    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def bf16_dot(a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(builder, "create_dot", bf16_dot)

    def bf16_dot_scaled(lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, fast_math, lhs_k_pack, rhs_k_pack, acc):
        # The interpreter reads bf16 operands of tl.dot_scaled through fp16 (losing range); the GPU does not.
        prepare = interpreter._prepare_dot_scaled_operand
        # Triton 3.9 added the scales' compute type (bf16 here: a power-of-two scale is exact in it); 3.8 has none.
        compute = {"compute_type": tl.bfloat16} if "compute_type" in inspect.signature(prepare).parameters else {}

        def operand(value, scale, fmt, k_pack, is_rhs):
            if value.dtype.scalar == tl.bfloat16:
                return widen(value).data
            return prepare(value, scale, fmt, k_pack, is_rhs=is_rhs, **compute)

        product = np.matmul(operand(lhs, lhs_scale, lhs_format, lhs_k_pack, False),
                            operand(rhs, rhs_scale, rhs_format, rhs_k_pack, True))  # fmt: skip
        return interpreter.TensorHandle((product + acc.data).astype(np.float32), tl.float32)

    if hasattr(builder, "create_dot_scaled"):
        monkeypatch.setattr(builder, "create_dot_scaled", bf16_dot_scaled)
    elif dot_scaled:  # Triton 3.6's interpreter (the H200 image's) has no tl.dot_scaled
        pytest.skip(f"Triton {triton.__version__}'s interpreter has no tl.dot_scaled (the CUDA tests run it compiled)")
    cast_impl = builder.cast_impl

    def rounding_cast(src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast_impl(src, dst_type)

    monkeypatch.setattr(builder, "cast_impl", rounding_cast)


SMALL = moe_triton.KernelConfig(16, 32, 64, 4, 1)  # BLOCK_K 64 < H = 96: a K tail; N tails on both GEMMs
SMALL_SWAPPED = moe_triton.KernelConfig(16, 32, 64, 4, 1, swap_ab=True)


@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(1, 1, 4), (5, 2, 8), (37, 6, 8)])
@pytest.mark.parametrize("form", ["fp4", "dense"])
def test_triton_kernel_matches_reference_in_the_interpreter(monkeypatch, tokens, top_k, experts, form):
    """The Triton kernels in Triton's CPU interpreter against the reference (CUDA runs them compiled).

    fp32: dots in IEEE fp32, only the summation order differs: |err| <= 1e-5 * max|ref| + 1e-6.
    bf16: the kernel's error against the fp32 truth is at most 1.5x the bf16 reference's own error
    (plus 2**-8 * max|ref|), i.e. the kernel rounds no worse than the reference does."""
    _interpret(monkeypatch)
    hidden, inter = 96, 32
    make = _fp4_weights if form == "fp4" else _dense_weights
    weights = make(experts, hidden, inter, seed=7 * tokens)
    ids, mix = _routing(tokens, top_k, experts, seed=tokens + 11)
    x = torch.randn(tokens, hidden, generator=_generator(tokens + 13))
    truth = routed_moe_reference(x, weights, ids, mix, LIMIT)
    scale = float(truth.abs().max())
    out = moe_triton.routed_moe_triton(x, weights, ids, mix, LIMIT, config=SMALL)
    assert out.dtype == torch.float32
    assert float((out - truth).abs().max()) <= 1e-5 * scale + 1e-6

    xb = x.bfloat16()
    out_bf16 = moe_triton.routed_moe_triton(xb, weights, ids, mix, LIMIT, config=SMALL)
    ref_bf16 = routed_moe_reference(xb, weights, ids, mix, LIMIT)
    truth_bf16_input = routed_moe_reference(xb.float(), weights, ids, mix, LIMIT)
    kernel_error = float((out_bf16.float() - truth_bf16_input).abs().max())
    reference_error = float((ref_bf16.float() - truth_bf16_input).abs().max())
    assert out_bf16.dtype == torch.bfloat16
    assert kernel_error <= 1.5 * reference_error + 2**-8 * scale


def test_triton_block_sizes_and_empty_batch(monkeypatch):
    """Bigger blocks than there are rows, and no tokens at all (no launch, zeros)."""
    _interpret(monkeypatch)
    weights = _fp4_weights(4, 64, 32, seed=5)
    ids, mix = _routing(3, 2, 4, seed=6)
    x = torch.randn(3, 64, generator=_generator(7))
    out = moe_triton.routed_moe_triton(x, weights, ids, mix, LIMIT, config=moe_triton.KernelConfig(64, 64, 128, 4, 1))
    truth = routed_moe_reference(x, weights, ids, mix, LIMIT)
    assert float((out - truth).abs().max()) <= 1e-5 * float(truth.abs().max()) + 1e-6
    empty = moe_triton.routed_moe_triton(x[:0], weights, ids[:0], mix[:0], LIMIT)
    assert empty.shape == (0, 64)
    assert moe_triton.choose_config(6, 256)[0] == 16 and moe_triton.choose_config(24576, 256)[0] == 128
    assert moe_triton.choose_config(24576, 256, fp4_dot=False)[0] == 64


def test_triton_swapped_operands_match_reference(monkeypatch):
    """``swap_ab`` (weights as the left operand of tl.dot_scaled) computes the same function; FP4, bf16 only."""
    _interpret(monkeypatch)
    weights = _fp4_weights(8, 96, 32, seed=21)
    ids, mix = _routing(37, 6, 8, seed=22)
    x = torch.randn(37, 96, generator=_generator(23)).bfloat16()
    truth = routed_moe_reference(x.float(), weights, ids, mix, LIMIT)
    reference_error = float((routed_moe_reference(x, weights, ids, mix, LIMIT).float() - truth).abs().max())
    out = moe_triton.routed_moe_triton(x, weights, ids, mix, LIMIT, config=SMALL_SWAPPED)
    assert float((out.float() - truth).abs().max()) <= 1.5 * reference_error + 2**-8 * float(truth.abs().max())
    plain = moe_triton.routed_moe_triton(x, weights, ids, mix, LIMIT, config=SMALL)
    assert float((out.float() - plain.float()).abs().max()) <= 2**-7 * float(truth.abs().max())


def test_triton_program_orders_compute_the_same(monkeypatch):
    """Both program orders (N tiles of a row block first, or row blocks of an N tile first) give identical
    results: each output tile is computed by one program the same way, only the launch order differs."""
    _interpret(monkeypatch)
    weights = _fp4_weights(8, 96, 64, seed=31)
    ids, mix = _routing(37, 6, 8, seed=32)
    x = torch.randn(37, 96, generator=_generator(33)).bfloat16()
    columns_first = moe_triton.routed_moe_triton(x, weights, ids, mix, LIMIT, config=SMALL)
    rows_first = moe_triton.routed_moe_triton(
        x, weights, ids, mix, LIMIT, config=moe_triton.KernelConfig(16, 32, 64, 4, 1, columns_first=False)
    )
    assert SMALL[-1] and torch.equal(columns_first, rows_first)
    truth = routed_moe_reference(x.float(), weights, ids, mix, LIMIT)
    reference_error = float((routed_moe_reference(x, weights, ids, mix, LIMIT).float() - truth).abs().max())
    assert float((rows_first.float() - truth).abs().max()) <= 1.5 * reference_error + 2**-8 * float(truth.abs().max())


@pytest.mark.parametrize(("tokens", "top_k", "form"), [(1, 6, "fp4"), (3, 2, "fp4"), (5, 1, "dense")])
@pytest.mark.parametrize("split_k", [2, 4])
def test_triton_split_k_matches_reference(monkeypatch, tokens, top_k, form, split_k):
    """K split over programs (fp32 partial sums, then the SwiGLU and combine kernels): the same function as the
    unsplit kernels within their bounds, for bf16 (FP4 dot) and fp32 activations, with K tails (H = 160 is not
    a whole number of BLOCK_K = 64 steps per split)."""
    _interpret(monkeypatch)
    hidden, inter, experts = 160, 128, 8
    weights = (_fp4_weights if form == "fp4" else _dense_weights)(experts, hidden, inter, seed=41 + tokens)
    ids, mix = _routing(tokens, top_k, experts, seed=42 + tokens)
    x = torch.randn(tokens, hidden, generator=_generator(43 + tokens))
    config = moe_triton.KernelConfig(16, 32, 64, 4, 1, split_k=split_k)
    truth = routed_moe_reference(x, weights, ids, mix, LIMIT)
    out = moe_triton.routed_moe_triton(x, weights, ids, mix, LIMIT, config=config)
    assert out.shape == truth.shape and out.dtype == torch.float32
    assert float((out - truth).abs().max()) <= 1e-5 * float(truth.abs().max()) + 1e-6
    xb = x.bfloat16()
    truth_bf16_input = routed_moe_reference(xb.float(), weights, ids, mix, LIMIT)
    reference_error = float((routed_moe_reference(xb, weights, ids, mix, LIMIT).float() - truth_bf16_input).abs().max())
    out_bf16 = moe_triton.routed_moe_triton(xb, weights, ids, mix, LIMIT, config=config)
    assert out_bf16.dtype == torch.bfloat16
    kernel_error = float((out_bf16.float() - truth_bf16_input).abs().max())
    assert kernel_error <= 1.5 * reference_error + 2**-8 * float(truth.abs().max())


def test_decode_split_only_splits_steps_too_small_for_the_gpu():
    config = moe_triton.choose_config(6, 256)
    assert moe_triton.decode_split(6, 256, config, 2048, 4096) == 4  # one token: 6 blocks x 32 tiles
    assert moe_triton.decode_split(12, 256, config, 2048, 4096) == 2
    assert moe_triton.decode_split(192, 256, config, 2048, 4096) == 1  # 32 tokens fill the GPU
    assert moe_triton.decode_split(6, 256, config, 256, 512) == 1  # too little K to split
    with pytest.raises(ValueError, match="split_k"):
        moe_triton.KernelConfig(16, 32, 64, split_k=3)


@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m"), [(1, 1, 4, 16), (1, 6, 256, 16), (37, 6, 8, 16),
                                                                     (12, 6, 256, 16), (40, 6, 8, 64)])  # fmt: skip
@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_fused_routing_layout_is_the_torch_layout(monkeypatch, tokens, top_k, experts, block_m, device):
    """The one-launch routing kernel writes exactly what align_slots(sort_slots(...)) computes: in Triton's
    interpreter on the CPU, compiled on CUDA."""
    triton = pytest.importorskip("triton")
    if device == "cpu":
        if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9):
            pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run the routing kernel (3.9's can)")
        _interpret(monkeypatch, dot_scaled=False)
    ids, _ = _routing(tokens, top_k, experts, seed=tokens)
    ids = ids.to(device)
    fused = moe_triton.align_slots_fused(ids, experts, block_m)
    expected = align_slots(sort_slots(ids, experts), block_m)
    for name in ("slot_ids", "block_expert", "num_blocks", "expert_block_ends"):
        assert torch.equal(getattr(fused, name), getattr(expected, name)), name
    assert (fused.pad_slot, fused.block_m) == (expected.pad_slot, expected.block_m)
    with pytest.raises(ValueError, match="slots"):
        moe_triton.align_slots_fused(torch.zeros(1, moe_triton.FUSED_ROUTING_SLOTS + 1, dtype=torch.int64), 4, 16)


def test_grouped_mm_backend_matches_reference():
    """torch's grouped GEMM (its CPU fallback here) over the padded layout; bf16 activations and weights."""
    weights = _dense_weights(8, 64, 32, seed=3, dtype=torch.bfloat16)
    ids, mix = _routing(37, 6, 8, seed=4)
    x = torch.randn(37, 64, generator=_generator(5)).bfloat16()
    out = routed_moe_grouped_mm(x, weights, ids, mix, LIMIT)
    truth = routed_moe_reference(x.float(), _dense_weights(8, 64, 32, seed=3, dtype=torch.bfloat16), ids, mix, LIMIT)
    reference_error = float((routed_moe_reference(x, weights, ids, mix, LIMIT).float() - truth).abs().max())
    assert float((out.float() - truth).abs().max()) <= 1.5 * reference_error + 2**-8 * float(truth.abs().max())
    with pytest.raises(ValueError, match="dense bf16 experts"):
        routed_moe_grouped_mm(x, _fp4_weights(8, 64, 32, seed=3), ids, mix, LIMIT)


def test_registry_and_weight_layout():
    names = [b.name for b in registry.backends("routed_moe")]
    assert names == ["triton", "reference", "grouped_mm"]
    assert registry.choose("routed_moe", "cpu", torch.bfloat16).name == "reference"
    with pytest.raises(ValueError, match="cannot run on cpu"):
        registry.choose("routed_moe", "cpu", torch.bfloat16, forced="triton")

    # stack_experts from per-expert checkpoint tensors (int8 codes, e8m0 scales) gives the documented layout.
    w1, s1 = quantize_fp4(torch.randn(2, 32, 64, generator=_generator(1)))
    w3, s3 = quantize_fp4(torch.randn(2, 32, 64, generator=_generator(2)))
    w2, s2 = quantize_fp4(torch.randn(2, 64, 32, generator=_generator(3)))
    stacked = stack_experts(list(w1), list(w3), list(w2), list(s1), list(s3), list(s2))
    assert stacked.is_fp4 and stacked.w13.shape == (2, 64, 32) and stacked.w13_scale.shape == (2, 64, 2)
    assert torch.equal(stacked.w13[1, 32:], w3[1].view(torch.uint8))
    assert stacked.nbytes == 2 * (64 * 32 + 64 * 2 + 64 * 16 + 64 * 1)
    dense = stack_experts([torch.ones(32, 64)] * 2, [torch.zeros(32, 64)] * 2, [torch.ones(64, 32)] * 2)
    assert not dense.is_fp4 and dense.w13.shape == (2, 64, 64) and dense.nbytes == 2 * (64 * 64 + 64 * 32) * 4
    with pytest.raises(ValueError, match="w13_scale must have shape"):
        ExpertWeights(stacked.w13, stacked.w13_scale[:, :, :1].contiguous(), stacked.w2, stacked.w2_scale, 32, True)
    with pytest.raises(ValueError, match="dense w13 must be"):
        ExpertWeights(dense.w13, None, dense.w2, None, 16, False)


def _signature(kernel, activation: str, weight: str) -> dict[str, str]:
    """Triton types of a kernel's runtime arguments, by the naming convention of dsinfer.ops.moe.triton."""
    pointers = {"x_ptr": activation, "h_ptr": activation, "out_ptr": activation, "w_ptr": weight,
                "s_ptr": "u8", "route_weight_ptr": "fp32"}  # fmt: skip
    types = {}
    for name in kernel.arg_names:
        if name.isupper():
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = "*" + pointers.get(name, "i64")
        else:
            types[name] = "fp32" if name == "limit" else "i32"
    return types


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_triton_kernels_compile_for_hopper():
    """The interpreter never compiles; this builds both kernels to sm_90 cubins with Triton's bundled ptxas (no
    GPU needed) in the configurations choose_config picks: FP4 through tl.dot_scaled for decode and prefill, and
    the dense path for prefill. All must use Hopper's wgmma and none may spill registers to local memory."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for fp4, tokens in ((True, 6), (True, 24576), (False, 24576)):
        config = moe_triton.choose_config(tokens, 256, fp4_dot=fp4)
        block_m, block_n, block_k, num_warps, num_stages, swap_ab, columns_first, split_k = config
        split_k = moe_triton.decode_split(tokens, 256, config, 2048, 4096)
        constants = dict(FP4=fp4, FP4_DOT=fp4, SWAP=swap_ab, IEEE=False, COLUMNS_FIRST=columns_first,
                         SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)  # fmt: skip
        for kernel in (moe_triton._gate_up_kernel, moe_triton._down_kernel):
            source = ASTSource(kernel, _signature(kernel, "bf16", "u8" if fp4 else "bf16"), constexprs=constants)
            options = dict(num_warps=num_warps, num_stages=num_stages)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
            assert compiled.asm["cubin"] and "wgmma" in compiled.asm["ptx"], (fp4, tokens, kernel.fn.__name__)
            assert "ld.local" not in compiled.asm["ptx"], (fp4, tokens, kernel.fn.__name__)


def test_triton_reads_offloaded_experts_through_the_slot_table(monkeypatch):
    """Experts stored in shuffled arena slots, read through ``slot_of_expert``: the Triton kernels in the
    interpreter against the reference (which runs them in id order, bit for bit the unshuffled result)."""
    _interpret(monkeypatch)
    plain = _fp4_weights(8, 96, 32, seed=31)
    slots = torch.randperm(11, generator=_generator(32))[:8]  # expert e in slot slots[e]; 3 slots unused
    parts = []
    for tensor in (plain.w13, plain.w13_scale, plain.w2, plain.w2_scale):
        arena_part = torch.zeros((11, *tensor.shape[1:]), dtype=tensor.dtype)
        arena_part[slots] = tensor
        parts.append(arena_part)
    arena = ExpertWeights(*parts, plain.intermediate_size, True)
    ids, mix = _routing(13, 6, 8, seed=33)
    x = torch.randn(13, 96, generator=_generator(34))
    truth = routed_moe_reference(x, plain, ids, mix, LIMIT)
    assert torch.equal(routed_moe_reference(x, arena, ids, mix, LIMIT, slot_of_expert=slots), truth)
    out = moe_triton.routed_moe_triton(x, arena, ids, mix, LIMIT, slot_of_expert=slots, config=SMALL)
    assert float((out - truth).abs().max()) <= 1e-5 * float(truth.abs().max()) + 1e-6
