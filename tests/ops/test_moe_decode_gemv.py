"""routed_moe's GEMV path for one- and two-token steps (dsinfer.ops.moe.decode_triton) against the reference:
in Triton's CPU interpreter on small shapes (tails of both K loops and of both kernels' columns, one expert
picked by both tokens, expert ids 0 and E-1, the SwiGLU clamps biting, a bad expert id), compiled on CUDA at
V4-Flash widths, and the dispatch from the triton backend.

Bounds: fp32 activations differ from the reference only in the order of fp32 additions (``1e-5 max|ref| +
1e-6``); with bf16 activations the kernels' error against the fp32 truth (the reference on the bf16 inputs
widened to fp32) is at most 1.5x the bf16 reference's own error plus ``2**-8 max|ref|``, as in test_moe."""

from __future__ import annotations

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops.moe import ExpertWeights, routed_moe_reference
from dsinfer.ops.moe.decode_triton import (
    DECODE_GEMV_CONFIG,
    DecodeGemvConfig,
    GemvConfig,
    use_decode_gemv,
)


def random_experts(experts: int, hidden: int, inter: int, seed: int, device="cpu", gain: int = 0) -> ExpertWeights:
    """Uniformly random code bytes (every e2m1 code, -0 included, in both nibbles) and ue8m0 scales around
    ``2**(gain - 3)``, different per row and group (so a wrong scale index or nibble order shows)."""
    gen = torch.Generator().manual_seed(seed)

    def codes(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)

    def scales(*shape):
        return torch.randint(122 + gain, 126 + gain, shape, dtype=torch.uint8, generator=gen)

    tensors = (
        codes(experts, 2 * inter, hidden // 2),
        scales(experts, 2 * inter, hidden // 32),
        codes(experts, hidden, inter // 2),
        scales(experts, hidden, inter // 32),
    )
    w13, w13_scale, w2, w2_scale = (t.to(device) for t in tensors)
    return ExpertWeights(w13, w13_scale, w2, w2_scale, inter, True)


def routing(tokens: int, top_k: int, experts: int, seed: int, ids=None, device="cpu"):
    """Distinct random experts per token (or the given ``ids``) and routing weights in 0.1 .. 1.1."""
    gen = torch.Generator().manual_seed(seed)
    if ids is None:
        ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=-1, sorted=False).indices
    else:
        ids = torch.tensor(ids, dtype=torch.int64)
    mix = torch.rand(ids.shape, generator=gen) + 0.1
    return ids.to(device), mix.to(device)


def small(gate_up: tuple[int, int], down: tuple[int, int], down_splits: int = 1) -> DecodeGemvConfig:
    return DecodeGemvConfig(GemvConfig(*gate_up, 4, 1), GemvConfig(*down, 4, 1), down_splits)


# (label, tokens, top_k, experts, hidden, inter, config, limit, ids). Kept to a few programs per launch: the
# interpreter's time goes per program and per operation, not per element.
CASES = [
    # Gate/up walks H = 96 in steps of 64 (a K tail); down tiles H = 96 by 64 (a column tail).
    ("one token", 1, 6, 8, 96, 64, small((32, 64), (64, 64)), 4.0, None),
    # Gate/up tiles I = 96 by 64 (a column tail); down walks I = 96 in steps of 64 (a K tail), two K steps.
    ("two tokens", 2, 3, 8, 64, 96, small((64, 64), (32, 64)), 4.0, None),
    # Expert E-1 picked by both tokens, expert 0 by one; one K step and one tile per launch.
    ("shared expert", 2, 2, 6, 64, 32, small((32, 64), (64, 32)), 4.0, [[5, 0], [2, 5]]),
    # The SwiGLU clamps bite on most of the gate and up values (checked against the reference's values).
    ("clamped", 2, 2, 4, 64, 32, small((32, 64), (64, 32)), 0.25, [[3, 1], [0, 3]]),
    # The down launch's slots split three ways, two slots each: a column tail and a K tail in every split.
    ("three splits", 2, 6, 8, 96, 96, small((64, 64), (64, 64), 3), 4.0, None),
    # Four splits asked of three slots: two splits (two slots at the least), the last of one slot; then two splits
    # of five slots, the last one short (three and two), whose missing step reads nothing new.
    ("two slots a split at the least", 1, 3, 6, 64, 64, small((64, 64), (64, 64), 4), 4.0, None),
    ("a short last split", 2, 5, 8, 64, 64, small((64, 64), (64, 64), 2), 4.0, None),
]
LIMIT_FOR_BAD_ID = 4.0


def bound_failures(label, got, want_fp32, want_dtype, dtype) -> list[str]:
    scale = float(want_fp32.abs().max())
    if got.shape != want_fp32.shape or got.dtype != dtype:
        return [f"{label} {dtype}: got {tuple(got.shape)} {got.dtype}"]
    error = float((got.float() - want_fp32).abs().max())
    if dtype == torch.float32:
        bound = 1e-5 * scale + 1e-6
    else:
        bound = 1.5 * float((want_dtype.float() - want_fp32).abs().max()) + 2**-8 * scale
    return [] if error <= bound else [f"{label} {dtype}: max error {error:.3g} over the bound {bound:.3g}"]


def clamped_fraction(x, weights: ExpertWeights, ids, limit: float) -> float:
    """The fraction of the reference's gate and up values (over every slot) that a clamp changes."""
    from dsinfer.ops.moe import dequantize_expert

    inter, hits, total = weights.intermediate_size, 0, 0
    for slot, expert in enumerate(ids.reshape(-1).tolist()):
        w13, _ = dequantize_expert(weights, expert, torch.float32)
        projected = w13 @ x[slot // ids.shape[1]].float()
        gate, up = projected[:inter], projected[inter:]
        hits += int((gate > limit).sum()) + int((up.abs() > limit).sum())
        total += 2 * inter
    return hits / total


def check(device: str, cases=CASES) -> list[str]:
    from dsinfer.ops.moe.decode_triton import routed_moe_decode_gemv

    failures = []
    for index, (label, tokens, top_k, experts, hidden, inter, config, limit, fixed) in enumerate(cases):
        weights = random_experts(experts, hidden, inter, seed=index, device=device)
        ids, mix = routing(tokens, top_k, experts, seed=index + 100, ids=fixed, device=device)
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(index + 200)).to(device)
        if (
            label == "clamped"
            and clamped_fraction(x.cpu(), random_experts(experts, hidden, inter, index), ids, limit) < 0.5
        ):
            failures.append(f"{label}: the clamps do not bite")
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            got = routed_moe_decode_gemv(xd, weights, ids, mix, limit, config=config)
            want_fp32 = routed_moe_reference(xd.float(), weights, ids, mix, limit)
            want_dtype = routed_moe_reference(xd, weights, ids, mix, limit)
            failures += bound_failures(label, got, want_fp32, want_dtype, dtype)
    # A bad expert id (-1, or E) is never read: its slot adds nothing, as a zero routing weight would.
    weights = random_experts(4, 64, 32, seed=9, device=device)
    ids, mix = routing(2, 4, 4, seed=10, ids=[[-1, 2, 0, 3], [1, 4, 3, 0]], device=device)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(11)).to(device)
    valid = ids.clamp(0, 3)
    want = routed_moe_reference(x, weights, valid, torch.where(ids == valid, mix, 0.0), LIMIT_FOR_BAD_ID)
    for splits in (1, 2):
        config = small((32, 64), (64, 32), splits)
        got = routed_moe_decode_gemv(x, weights, ids, mix, LIMIT_FOR_BAD_ID, config=config)
        failures += bound_failures(f"bad expert id, {splits} splits", got, want, want, torch.float32)
    from dsinfer.ops.split_arrivals import ARRIVAL_COUNTS

    counts = next((c for (d, _), c in ARRIVAL_COUNTS.items() if d.type == torch.device(device).type), None)
    if counts is None or int(counts.abs().sum()):  # every split launch sets its tiles' counts back to zero
        failures.append(f"split counts after the launches: {None if counts is None else counts.nonzero()}")
    return failures


def run_interpreted_cases() -> list[str]:
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()  # the interpreter's float32 -> bf16 cast truncates: round to nearest even
    return check("cpu")


def test_gemv_kernels_match_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_moe_decode_gemv")


FLASH = dict(experts=256, hidden=4096, inter=2048, top_k=6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
@pytest.mark.parametrize("tokens", [1, 2])
def test_gemv_kernels_match_reference_on_cuda_at_flash_widths(tokens):
    """V4-Flash widths with the default launches, against the reference and against the grouped kernels."""
    from dsinfer.ops.moe.triton import routed_moe_triton

    experts, hidden, inter, top_k = FLASH["experts"], FLASH["hidden"], FLASH["inter"], FLASH["top_k"]
    weights = random_experts(experts, hidden, inter, seed=tokens, device="cuda", gain=-3)
    ids, mix = routing(tokens, top_k, experts, seed=tokens, device="cuda")
    if tokens == 2:
        ids[1, 0] = ids[0, 0]  # one expert picked by both tokens
    ids[0, 1], ids[-1, -1] = 0, experts - 1
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).cuda()
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got = routed_moe_triton(xd, weights, ids, mix, 10.0, gemv=True)  # whatever DECODE_GEMV_MAX_TOKENS says
        want_fp32 = routed_moe_reference(xd.float(), weights, ids, mix, 10.0)
        want_dtype = routed_moe_reference(xd, weights, ids, mix, 10.0)
        assert bound_failures(f"T={tokens}", got, want_fp32, want_dtype, dtype) == []
        grouped = routed_moe_triton(xd, weights, ids, mix, 10.0, gemv=False)
        scale = float(want_fp32.abs().max())
        assert float((got.float() - grouped.float()).abs().max()) <= 2**-7 * scale


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
def test_gemv_path_replays_in_a_cuda_graph():
    """No host synchronisation: captured once, replayed after the routing changes in place."""
    from dsinfer.ops.moe.triton import routed_moe_triton

    weights = random_experts(16, 256, 128, seed=1, device="cuda")
    ids, mix = routing(1, 4, 16, seed=2, device="cuda")
    x = torch.randn(1, 256, device="cuda").bfloat16()
    routed_moe_triton(x, weights, ids, mix, 4.0, gemv=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = routed_moe_triton(x, weights, ids, mix, 4.0, gemv=True)
    new_ids, new_mix = routing(1, 4, 16, seed=3, device="cuda")
    ids.copy_(new_ids)
    mix.copy_(new_mix)
    graph.replay()
    torch.cuda.synchronize()
    truth = routed_moe_reference(x.float(), weights, ids, mix, 4.0)
    reference_error = float((routed_moe_reference(x, weights, ids, mix, 4.0).float() - truth).abs().max())
    assert float((out.float() - truth).abs().max()) <= 1.5 * reference_error + 2**-8 * float(truth.abs().max())


def test_dispatch_takes_the_gemv_path_for_small_fp4_steps(monkeypatch):
    """``routed_moe_triton`` hands steps of 1 .. DECODE_GEMV_MAX_TOKENS tokens (0: none) over FP4 experts to the
    GEMV path unless a grouped ``config`` or ``gemv=False`` is given; dense experts and bigger steps stay grouped."""
    pytest.importorskip("triton")
    import dsinfer.ops.moe.decode_triton as decode
    import dsinfer.ops.moe.triton as moe_triton

    calls = []
    monkeypatch.setattr(decode, "routed_moe_decode_gemv", lambda *args, **kwargs: calls.append(args) or "gemv")
    limit = 2  # DSINFER_MOE_GEMV_MAX_TOKENS=2
    monkeypatch.setattr(decode, "DECODE_GEMV_MAX_TOKENS", limit)
    weights = random_experts(4, 64, 32, seed=0)
    for tokens in range(1, limit + 1):
        ids, mix = routing(tokens, 2, 4, seed=tokens)
        x = torch.randn(tokens, 64)
        assert moe_triton.routed_moe_triton(x, weights, ids, mix, 1.0) == "gemv"
    assert len(calls) == limit
    monkeypatch.setattr(decode, "DECODE_GEMV_MAX_TOKENS", 0)  # the path off: every step grouped
    assert not use_decode_gemv(torch.randn(1, 64), weights, routing(1, 2, 4, seed=1)[0])
    monkeypatch.setattr(decode, "DECODE_GEMV_MAX_TOKENS", limit)
    ids, mix = routing(limit + 1, 2, 4, seed=0)
    assert not use_decode_gemv(torch.randn(len(ids), 64), weights, ids)
    dense = ExpertWeights(torch.zeros(4, 64, 64), None, torch.zeros(4, 64, 32), None, 32, False)
    assert not use_decode_gemv(torch.randn(1, 64), dense, ids[:1])
    assert not use_decode_gemv(torch.randn(0, 64), weights, ids[:0])
    with pytest.raises(ValueError, match="block_k"):
        GemvConfig(32, 16).validate()


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_gemv_kernels_compile_for_hopper_without_spills():
    """The interpreter never compiles: build both kernels to sm_90 cubins (Triton's bundled ptxas, no GPU) in
    the default launches, specialised as a launch at V4-Flash widths is (pointers and the sizes and strides
    that are multiples of 16 marked so); neither may spill registers to local memory, and the code words must
    load 16 bytes at a time (a layout that loses that reads them 4 bytes at a time)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsinfer.ops.moe import decode_triton

    pointers = {"x_ptr": "*bf16", "h_ptr": "*bf16", "out_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8",
                "ids_ptr": "*i64", "route_weight_ptr": "*fp32", "partial_ptr": "*fp32",
                "arrived_ptr": "*i32"}  # fmt: skip
    kernels = ((decode_triton._gate_up_gemv_kernel, DECODE_GEMV_CONFIG.gate_up),
               (decode_triton._down_gemv_kernel, DECODE_GEMV_CONFIG.down))  # fmt: skip
    for kernel, launch in kernels:
        aligned = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(kernel.arg_names)
                   if name.endswith("_ptr") or name.endswith("_stride") or name in ("hidden", "inter")}  # fmt: skip
        for even in (True, False):  # V4-Flash widths are whole tiles; the masked form serves other widths
            signature = {name: pointers.get(name, "fp32" if name == "limit" else "i32") for name in kernel.arg_names}
            constants = dict(BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, EVEN=even, PDL=True, PTX=True)
            if kernel is decode_triton._down_gemv_kernel:
                constants["SPLIT"] = even  # the split launch's reduction compiles in one of the two forms
            signature.update({name: "constexpr" for name in constants})
            source = ASTSource(kernel, signature, constexprs=constants, attrs=aligned)
            options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
            name = (kernel.fn.__name__, even)
            assert compiled.asm["cubin"], name
            assert "ld.local" not in compiled.asm["ptx"], name
            assert "ld.global.v4.b32" in compiled.asm["ptx"], name
            assert "cvt.f32.f16" in compiled.asm["ptx"], name  # the decoded pairs read by inline PTX


def test_down_launch_serves_both_widths_and_splits_by_request(monkeypatch):
    """V4-Flash's intermediate size (2048, whole steps) and V4.1-Flash's (2304, a masked last step) take the default
    launches, the down launch split three ways; ``DSINFER_MOE_DOWN_SPLITS`` changes only the splits."""
    from dsinfer.ops.moe import decode_triton

    assert decode_triton.decode_gemv_config(2048) == DECODE_GEMV_CONFIG
    assert decode_triton.decode_gemv_config(2304) == DECODE_GEMV_CONFIG
    assert DECODE_GEMV_CONFIG.down_splits == 3
    monkeypatch.setattr(decode_triton, "DOWN_SPLITS", "1")
    assert decode_triton.decode_gemv_config(2304) == DECODE_GEMV_CONFIG._replace(down_splits=1)
    with pytest.raises(ValueError, match="down_splits"):
        DECODE_GEMV_CONFIG._replace(down_splits=0).validate()
    # Splits keep two slots at the least: V4's six slots go three ways, a step of two slots runs unsplit.
    out = torch.empty(1, 64)
    assert decode_triton._plan_down_splits(3, 6, 1, 4, out)[:2] == (2, 3)
    assert decode_triton._plan_down_splits(6, 6, 1, 4, out)[:2] == (2, 3)
    assert decode_triton._plan_down_splits(3, 2, 1, 4, out)[:2] == (2, 1)
