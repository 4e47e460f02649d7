"""``rope_and_round``: a row's weighted RMSNorm, RoPE and V4.1 rounding in one kernel (Triton's interpreter on the
CPU, compiled on CUDA) against the unfused Triton kernels (``rms_norm``, ``rope``, ``fake_quant_*``) and against
the reference.

Without a norm the op is bit-identical to the reference (RoPE and the rounding are). With one, in bf16 and fp16
it equals the unfused kernels bit for bit; in float32 the compiler may sum a row's squares in another order than
the norm kernel (on the H200 about 5% of the float32 elements of a norm and RoPE without rounding differ in their
last bits), so there the result must be within the norm's tolerance of the unfused kernels, and after a rounding,
where a last-bit difference can move a value across a rounding boundary, at least 99% of the elements must agree.
The chains are V4.1's (window K=V: norm, FP8 in blocks of 32; compressed entries: FP4
with e4m3 scales in blocks of 16; index keys: norm, FP4 with ue8m0 scales in blocks of 32; index queries [N,
heads, 128]), V4's ``kv_norm`` and RoPE without rounding, and a width that is no power of two; layouts:
contiguous rows, the columns of a wider GEMM output, one token's angles shared by all; zero tokens.
"""

from __future__ import annotations

import pytest
import torch
from hopper_build import register_spills
from interpreted import assert_interpreted_cases_pass
from test_norm_rope_triton import make_inputs as rows_and_angles

from dsinfer.ops import registry
from dsinfer.ops.rope_round.reference import RopeRoundInputs, rope_and_round_reference, round_rows

# Rows per program: 4 at 512 channels, 16 at 128 and 96: 5 and 17 tokens end every chain in a partial program, 17
# after one or more whole ones.
TOKENS = (0, 1, 5, 17)
# (middle axes, dim, rope_dim, has weight, rounding, block)
CHAINS = (
    ((), 512, 64, True, "fp8", 32),  # V4.1 window K=V
    ((), 512, 64, False, "fp4_e4m3", 16),  # V4.1 compressed entries
    ((), 128, 64, True, "fp4_ue8m0", 32),  # V4.1 index keys
    ((4,), 128, 64, False, "fp4_ue8m0", 32),  # V4.1 index queries
    ((), 512, 64, True, None, 0),  # V4 kv_norm + RoPE
    ((), 96, 32, True, "fp8", 32),  # a width that is no power of two
)
DTYPES = (torch.bfloat16, torch.float32, torch.float16)
LAYOUTS = ("contiguous", "columns", "shared")


def make_inputs(tokens, middle, dim, rope_dim, has_weight, dtype, layout, generator, device):
    """The norm and RoPE test's rows and angles (:func:`test_norm_rope_triton.make_inputs`), and a norm weight."""
    x, cos, sin = rows_and_angles(tokens, middle, dim, rope_dim, dtype, layout, generator, device)
    weight = (torch.rand(dim, generator=generator) + 0.5).to(device) if has_weight else None
    return x, cos, sin, weight


def cases():
    for tokens in TOKENS:
        for chain in CHAINS:
            for dtype in DTYPES:
                for layout in LAYOUTS:
                    yield tokens, chain, dtype, layout


def unfused(x, cos, sin, weight, rounding, block):
    """The chain as the separate Triton kernels run it."""
    from dsinfer.ops.fake_quant.triton import fake_quant_fp4_triton, fake_quant_fp8_triton
    from dsinfer.ops.norm_rope.rms_norm_triton import rms_norm_triton
    from dsinfer.ops.norm_rope.rope_triton import rope_triton

    y = rms_norm_triton(x, weight, 1e-6) if weight is not None else x
    y = rope_triton(y.clone() if weight is None else y, cos, sin, False, True)  # in place: the rope kernel itself
    if rounding == "fp8":
        return fake_quant_fp8_triton(y, block)
    if rounding is not None:
        return fake_quant_fp4_triton(y, block, rounding == "fp4_e4m3")
    return y


def check_cases(device: torch.device) -> list[str]:
    import dsinfer.ops.rope_round.triton as backend

    failures = []
    generator = torch.Generator().manual_seed(0)
    for tokens, (middle, dim, rope_dim, has_weight, rounding, block), dtype, layout in cases():
        label = f"N={tokens} middle={middle} dim={dim} weight={has_weight} {rounding}/{block} {dtype} {layout}"
        x, cos, sin, weight = make_inputs(tokens, middle, dim, rope_dim, has_weight, dtype, layout, generator, device)
        if not backend.takes(x, cos, sin, weight, rounding, block):
            failures.append(f"{label}: the kernel does not take it")
            continue
        before = x.clone()
        got = backend.rope_and_round_triton(RopeRoundInputs(x, cos, sin, weight, 1e-6, rounding, block))
        # Without a norm the reference is the truth; only a norm's chain is checked against the unfused kernels.
        want = unfused(x, cos, sin, weight, rounding, block) if weight is not None else None
        if got.dtype != x.dtype or got.shape != x.shape or not got.is_contiguous():
            failures.append(f"{label}: got {got.dtype} {tuple(got.shape)}, want {x.dtype} {tuple(x.shape)}")
            continue
        if weight is None:  # RoPE and the rounding are the reference's bits
            reference = rope_and_round_reference(RopeRoundInputs(x, cos, sin, None, 1e-6, rounding, block))
            if not torch.equal(got, reference):
                failures.append(f"{label}: {(got != reference).sum().item()} elements differ from the reference")
        elif dtype != torch.float32 and not torch.equal(got, want):
            failures.append(f"{label}: {(got != want).sum().item()} elements differ from the unfused kernels")
        elif rounding is None and not ((got - want).abs() <= (want.abs() + 8) * 2**-22).all():
            failures.append(f"{label}: max |diff| from the unfused kernels {(got - want).abs().max():.3g}")
        elif rounding is not None and got.numel() and (got == want).float().mean().item() < 0.99:
            failures.append(f"{label}: only {(got == want).float().mean().item():.3f} equal the unfused kernels")
        if not torch.equal(x, before):
            failures.append(f"{label}: the input changed")
    return failures


def run_interpreted_cases() -> list[str]:
    """Every case through the interpreter (TRITON_INTERPRET=1 must be set before Triton loads)."""
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()  # the interpreter's float32 -> bf16 cast truncates: round to nearest even
    return check_cases(torch.device("cpu"))


def test_triton_rope_and_round_matches_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_rope_round")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_rope_and_round_matches_on_cuda():
    assert check_cases(torch.device("cuda")) == []


def test_registry_picks_reference_on_cpu_and_triton_on_cuda():
    assert registry.choose("rope_and_round", "cpu", torch.float32).name == "reference"
    if torch.cuda.is_available():
        assert registry.choose("rope_and_round", "cuda", torch.bfloat16).name == "triton"


def test_inputs_the_kernel_does_not_take_go_to_the_reference():
    import dsinfer.ops.rope_round.triton as backend

    angles = torch.rand(3, 8)
    x = torch.randn(3, 48)
    assert not backend.takes(x, angles.cos(), angles.sin(), None, "fp8", 32)  # 48 channels: no whole blocks
    inputs = RopeRoundInputs(x, angles.cos(), angles.sin(), None, 1e-6, "fp8", 32)
    got = backend.rope_and_round_triton(inputs)
    assert torch.equal(got, rope_and_round_reference(inputs))
    assert torch.equal(got[:, :32], x[:, :32])  # the reference passes a row of no whole block through unrounded


def test_reference_is_norm_then_rope_then_rounding():
    from dsinfer.ops.fake_quant.reference import fake_quant_fp8
    from dsinfer.ops.norm_rope.reference import rms_norm_reference, rope_reference

    x, weight, angles = torch.randn(4, 64).bfloat16(), torch.rand(64) + 0.5, torch.rand(4, 8)
    got = rope_and_round_reference(RopeRoundInputs(x, angles.cos(), angles.sin(), weight, 1e-6, "fp8", 32))
    want = fake_quant_fp8(rope_reference(rms_norm_reference(x, weight, 1e-6), angles.cos(), angles.sin()), 32)
    assert torch.equal(got, want)
    assert not torch.equal(got, rope_reference(rms_norm_reference(x, weight, 1e-6), angles.cos(), angles.sin()))


def test_unknown_rounding_is_an_error_naming_it():
    with pytest.raises(ValueError, match="fp6"):
        round_rows(torch.randn(2, 32), "fp6", 32)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernel_compiles_for_hopper_in_every_variant():
    """The interpreter never compiles: build the row-chain kernel to sm_90 cubins with Triton's bundled ptxas (no GPU
    needed) in the variants the models launch (rows of 512 and 128 channels, 64 rope channels; no norm, the
    weighted and the weightless norm; no rounding and each format), without register spills."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import dsinfer.ops.norm_rope.row_chain_triton as backend
    from dsinfer.ops.norm_rope.rms_norm_triton import norm_launch_shape

    kernel = backend._row_chain_kernel
    pointers = {"src": "*bf16", "dst": "*bf16", "weight": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
    signature = {
        name: "constexpr" if name.isupper() else pointers.get(name, "fp32" if name == "eps" else "i64")
        for name in kernel.arg_names
    }
    variants = [(512, norm, rounding, block) for norm in (0, 1, 2) for rounding, block in ((None, 1), ("fp8", 32))]
    variants += [(512, 0, "fp4_e4m3", 16), (128, 1, "fp4_ue8m0", 32), (128, 0, "fp4_ue8m0", 32)]
    for width, norm, rounding, block in variants:
        row_block, per_program, warps = norm_launch_shape(width)
        constants = dict(NOPE=width - 64, NORM=norm, KIND=backend.KINDS[rounding], QUANT_BLOCK=block,
                         ROWS=per_program, BLOCK=row_block)  # fmt: skip
        source = ASTSource(kernel, signature, constexprs=constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        label = (width, norm, rounding)
        assert compiled.asm["cubin"] and "ld.local" not in compiled.asm["ptx"], label
        assert register_spills(compiled.asm["cubin"]) in (0, None), label
