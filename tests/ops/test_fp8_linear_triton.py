"""The ``fp8_linear`` Triton backend (dsinfer.ops.fp8_linear.triton) against the reference: the kernel in Triton's
CPU interpreter on small shapes (one token, a token tail in one block, two token blocks, row and column tails,
several scale blocks, grouped projections, ue8m0 and float32 scales, codes at both ends of e4m3 and subnormal),
the one-pass dequantisation bit for bit, the dispatch (few tokens: the kernel; more: the dequantised weight),
clear errors for bad shapes, and the kernel compiled for sm_90 without register spills.

Bounds: the kernel differs from the reference only in the order of float32 additions. fp32: ``1e-5 max|ref| +
1e-6``. bf16 / fp16 outputs: within 1.5x the dtype reference's own error against the float32 truth plus one unit
of the dtype's rounding at the output's scale."""

from __future__ import annotations

import pytest
import torch
from hopper_build import register_spills
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops.fp8_linear import Fp8Weight, fp8_linear_reference
from dsinfer.ops.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise

# (label, tokens, rows, inputs, groups, block, config (block_n, block_k, warps, stages[, splits]) or None)
CASES = [
    ("split in three, a short last split", 3, 32, 80, 1, (16, 16), (16, 16, 1, 1, 3)),
    ("split, two token blocks and a row tail", 20, 40, 64, 1, (16, 32), (16, 16, 1, 1, 2)),
    ("split, grouped", 2, 2 * 32, 2 * 64, 2, (32, 32), (32, 32, 1, 1, 2)),
    ("one token", 1, 48, 96, 1, (32, 32), (16, 32, 1, 1)),
    ("token tail", 5, 32, 64, 1, (16, 32), (16, 32, 1, 1)),
    ("two token blocks", 70, 16, 32, 1, (16, 32), (16, 32, 1, 1)),
    ("row and column tails", 3, 40, 72, 1, (32, 32), (32, 32, 1, 1)),
    ("scale steps wider than a step", 2, 32, 128, 1, (16, 64), (16, 32, 1, 1)),
    ("grouped", 3, 64, 2 * 48, 2, (16, 16), (16, 16, 1, 1)),
    ("grouped, chosen launch", 2, 4 * 32, 4 * 64, 4, (32, 64), None),
]


def random_weight(rows: int, inputs: int, block, scale_dtype, seed: int):
    """Codes from a random weight with block magnitudes spread over 2**-12 .. 2**4 (so the scales differ per block
    and some codes are e4m3 subnormals), plus the codes +-448 and the smallest subnormal planted."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, inputs, generator=gen)
    spread = torch.randint(-12, 5, (-(-rows // block[0]), -(-inputs // block[1])), generator=gen).float().exp2()
    weight = weight * spread.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :inputs]
    codes, scale = quantize_fp8_blockwise(weight, block, scale_dtype)
    flat = codes.view(torch.uint8).view(-1)
    flat[:3] = torch.tensor([0x7E, 0xFE, 0x01], dtype=torch.uint8)  # 448, -448, 2**-9
    return codes, scale


# One-token GEMV cases: (label, rows, inputs, groups, block, config (block_n, block_k, warps, splits)).
GEMV_CASES = [
    ("gemv, an input tail", 32, 72, 1, (16, 16), (8, 32, 1, 1)),
    ("gemv, split in three", 16, 96, 1, (16, 32), (16, 16, 1, 3)),
    ("gemv, grouped and split", 2 * 16, 2 * 64, 2, (16, 16), (8, 32, 1, 2)),
    ("gemv, the default launch", 32, 1024 + 64, 1, (32, 32), None),
]


def bound_failures(label, got, x, codes, scale, block, dtype, groups) -> list[str]:
    want = fp8_linear_reference(x, Fp8Weight(codes, scale, block), dtype, groups)
    truth = fp8_linear_reference(x.float(), Fp8Weight(codes, scale, block), torch.float32, groups)
    if got.shape != want.shape or got.dtype != dtype:
        return [f"{label} {dtype}: got {tuple(got.shape)} {got.dtype}, expected {tuple(want.shape)} {dtype}"]
    magnitude = float(truth.abs().max())
    error = float((got.float() - truth).abs().max())
    if dtype == torch.float32:
        bound = 1e-5 * magnitude + 1e-6
    else:
        bound = 1.5 * float((want.float() - truth).abs().max()) + torch.finfo(dtype).eps * magnitude
    return [] if error <= bound else [f"{label} {dtype}: max error {error:.3g} over the bound {bound:.3g}"]


def check(device: str) -> list[str]:
    from dsinfer.ops.fp8_linear.triton import Fp8KernelConfig, dequantize_fp8_triton, fp8_linear_kernel

    failures = []
    for index, (label, tokens, rows, inputs, groups, block, config) in enumerate(CASES):
        for scale_dtype in (torch.float8_e8m0fnu, torch.float32):
            codes, scale = random_weight(rows, inputs // groups, block, scale_dtype, seed=index)
            codes, scale = codes.to(device), scale.to(device)
            x = torch.randn(tokens, inputs, generator=torch.Generator().manual_seed(index + 50)).to(device)
            launch = Fp8KernelConfig(*config) if config else None
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                got = fp8_linear_kernel(x.to(dtype), Fp8Weight(codes, scale, block), dtype, groups, config=launch)
                failures += bound_failures(f"{label} ({scale_dtype})", got.cpu(), x.to(dtype).cpu(), codes.cpu(),
                                           scale.cpu(), block, dtype, groups)  # fmt: skip
            for dtype in (torch.float32, torch.bfloat16):
                got = dequantize_fp8_triton(codes, scale, block, dtype)
                want = dequantize_fp8_blockwise(codes, scale, block, dtype=dtype)
                if not torch.equal(got, want):
                    failures.append(f"{label} ({scale_dtype}) dequantise {dtype}: not bit for bit")
    from dsinfer.ops.fp8_linear.gemv_triton import Fp8GemvConfig, fp8_gemv

    for index, (label, rows, inputs, groups, block, config) in enumerate(GEMV_CASES):
        for scale_dtype in (torch.float8_e8m0fnu, torch.float32):
            codes, scale = random_weight(rows, inputs // groups, block, scale_dtype, seed=index + 30)
            x = torch.randn(1, inputs, generator=torch.Generator().manual_seed(index + 80))
            launch = Fp8GemvConfig(*config) if config else None
            for dtype in (torch.float32, torch.bfloat16):
                weight = Fp8Weight(codes.to(device), scale.to(device), block)
                got = fp8_gemv(x.to(dtype).to(device), weight, dtype, groups, config=launch)
                failures += bound_failures(f"{label} ({scale_dtype})", got.cpu(), x.to(dtype), codes, scale, block,
                                           dtype, groups)  # fmt: skip
    # Every split launch set its tiles' counts back to zero for the next launch.
    from dsinfer.ops.split_arrivals import ARRIVAL_COUNTS

    counts = next((c for (d, _), c in ARRIVAL_COUNTS.items() if d.type == torch.device(device).type), None)
    if counts is None or int(counts.abs().sum()) != 0:
        failures.append(f"split launches left counts {None if counts is None else int(counts.abs().sum())}")
    # Lead dimensions and a strided input (a column slice) keep the reference's shape.
    codes, scale = random_weight(32, 64, (32, 32), torch.float8_e8m0fnu, seed=99)
    wide = torch.randn(2, 3, 96, generator=torch.Generator().manual_seed(7)).to(device)
    got = fp8_linear_kernel(wide[..., :64], Fp8Weight(codes.to(device), scale.to(device), (32, 32)), torch.float32,
                            config=Fp8KernelConfig(16, 32, 1, 1))  # fmt: skip
    failures += bound_failures("strided lead dims", got.cpu(), wide[..., :64].cpu(), codes, scale, (32, 32),
                               torch.float32, 1)  # fmt: skip
    return failures


def run_interpreted_cases() -> list[str]:
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()  # the interpreter's float32 -> bf16 cast truncates: round to nearest even
    return check("cpu")


def test_fp8_linear_kernel_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_fp8_linear_triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_linear_kernel_matches_reference_on_cuda():
    assert check("cuda") == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8, 64, 65, 300])
def test_fp8_linear_backend_on_cuda_at_flash_widths(tokens):
    """The backend at V4-Flash's wo_b and grouped wo_a shapes: the kernel up to 64 tokens, the dequantised weight
    above; both within the bf16 bound of the truth."""
    from dsinfer.ops.fp8_linear.triton import fp8_linear_triton

    for rows, inputs, groups in ((4096, 8192, 1), (8192, 8 * 4096, 8)):
        codes, scale = random_weight(rows, inputs // groups, (128, 128), torch.float8_e8m0fnu, seed=tokens)
        codes, scale = codes.cuda(), scale.cuda()
        x = torch.randn(tokens, inputs, device="cuda", dtype=torch.bfloat16)
        got = fp8_linear_triton(x, Fp8Weight(codes, scale, (128, 128)), torch.bfloat16, groups)
        failures = bound_failures("flash", got, x, codes, scale, (128, 128), torch.bfloat16, groups)
        assert failures == []


def test_dispatch_and_errors(monkeypatch):
    """One token takes the GEMV, a few the kernel, more the dequantised weight, and inputs the kernels do not take
    the reference; a grouped call whose shapes do not cut into the groups is one clear error on every backend."""
    pytest.importorskip("triton")
    from dsinfer.ops.fp8_linear import triton as backend

    calls = []
    monkeypatch.setattr(backend, "fp8_linear_kernel", lambda *a, **k: calls.append("kernel") or "k")
    monkeypatch.setattr(backend, "fp8_gemv", lambda *a, **k: calls.append("gemv") or "g")
    monkeypatch.setattr(backend, "dequantize_fp8_triton", lambda codes, scale, block, dtype: calls.append("dequant")
                        or dequantize_fp8_blockwise(codes, scale, block, dtype=dtype))  # fmt: skip
    codes, scale = random_weight(32, 64, (32, 32), torch.float8_e8m0fnu, seed=3)
    weight = Fp8Weight(codes, scale, (32, 32))
    few, many = torch.randn(backend.MAX_KERNEL_TOKENS, 64), torch.randn(backend.MAX_KERNEL_TOKENS + 1, 64)
    assert backend.fp8_linear_triton(few, weight, torch.float32) == "k"
    assert backend.fp8_linear_triton(few[:1], weight, torch.float32) == "g"  # one token: the GEMV
    out = backend.fp8_linear_triton(many, weight, torch.float32)
    torch.testing.assert_close(out, fp8_linear_reference(many, weight, torch.float32))
    monkeypatch.setenv("DSINFER_FP8_KERNEL_MAX_TOKENS", "0")
    backend.fp8_linear_triton(few[:1], weight, torch.float32)
    assert calls == ["kernel", "gemv", "dequant", "dequant"]
    # A weight over the GEMV's size limit goes to the kernel unless its rows are long; 0 turns the GEMV off.
    from dsinfer.ops.fp8_linear import gemv_triton

    monkeypatch.delenv("DSINFER_FP8_KERNEL_MAX_TOKENS")
    monkeypatch.setenv("DSINFER_FP8_GEMV_MAX_WEIGHT", str(codes.numel() - 1))
    backend.fp8_linear_triton(few[:1], weight, torch.float32)
    monkeypatch.setattr(gemv_triton, "GEMV_MIN_INPUTS", codes.shape[1])
    backend.fp8_linear_triton(few[:1], weight, torch.float32)
    monkeypatch.setenv("DSINFER_FP8_GEMV_MAX_WEIGHT", "0")
    backend.fp8_linear_triton(few[:1], weight, torch.float32)
    assert calls[4:] == ["kernel", "gemv", "kernel"]
    monkeypatch.setenv("DSINFER_FP8_KERNEL_MAX_TOKENS", "0")  # the grouped calls below: the dequantised weight
    grouped = torch.randn(3, 2 * 64)
    out = backend.fp8_linear_triton(grouped, weight, torch.float32, groups=2)
    torch.testing.assert_close(out, fp8_linear_reference(grouped, weight, torch.float32, groups=2))
    # A dtype other than the compute dtype is the reference's to handle (it raises as F.linear would).
    assert not backend.serves(few.double(), weight, torch.float32, 1)
    assert not backend.serves(few, weight, torch.float32, 32)  # one row a group: no 16-row tile
    for fn in (fp8_linear_reference, backend.fp8_linear_triton):
        with pytest.raises(ValueError, match="do not split into 3 groups"):
            fn(grouped, weight, torch.float32, 3)
        with pytest.raises(ValueError, match="expected 2 groups x 64 = 128"):
            fn(torch.randn(3, 100), weight, torch.float32, 2)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_fp8_linear_kernel_compiles_for_hopper_without_spills():
    """The interpreter never compiles: build the kernels to sm_90 cubins (Triton's bundled ptxas, no GPU): the
    launches choose_config gives V4-Flash's shapes at 1 and 32 tokens, the one-token GEMV's two launches (split and
    not) and the dequantiser; no register may spill to the stack (the GEMV's default launch: 16 bytes at most)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dsinfer.ops.fp8_linear import gemv_triton
    from dsinfer.ops.fp8_linear import triton as backend

    kernels = []
    for rows, tokens in ((4096, 1), (4096, 32), (40960, 32)):
        config = backend.choose_config(rows, rows, (128, 128), tokens)
        for split in (False, True):
            constants = dict(BLOCK_M=max(16, tokens), BLOCK_N=config.block_n, BLOCK_K=config.block_k, IEEE=False,
                             SPLIT_K=split)  # fmt: skip
            kernels.append((backend._fp8_linear_kernel, constants, config.warps, config.stages))
    kernels.append((backend._dequantize_kernel, dict(BLOCK_R=32, BLOCK_C=128), 4, 1))
    gemv = gemv_triton.DEFAULT_GEMV
    for split in (False, True):
        for launch in (gemv, gemv_triton.GROUPED_GEMV, gemv_triton.TALL_GEMV):
            constants = dict(BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, SPLIT_K=split, PDL=True)
            kernels.append((gemv_triton._fp8_gemv_kernel, constants, launch.warps, 1))
    for kernel, constants, warps, stages in kernels:
        constants.update(SCALE_ROWS=128, SCALE_COLS=128, SCALE_BYTES=True, HARDWARE_FP8=True)
        pointers = {"x_ptr": "*bf16", "codes_ptr": "*u8", "scale_ptr": "*u8", "out_ptr": "*bf16",
                    "partial_ptr": "*fp32", "arrived_ptr": "*i32"}  # fmt: skip
        signature = {name: pointers.get(name, "i32") for name in kernel.arg_names}
        signature.update({name: "constexpr" for name in constants})
        aligned = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(kernel.arg_names)
                   if name.endswith("_ptr") or name in ("K", "N", "stride_xm", "stride_om", "k_per_split")}  # fmt: skip
        source = ASTSource(kernel, signature, constexprs=constants, attrs=aligned)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=stages))  # fmt: skip
        assert compiled.asm["cubin"], kernel.fn.__name__
        spills = register_spills(compiled.asm["cubin"])
        # The GEMV's default launch (four warps of 1024-column steps, the H200's fastest with no weight in L2)
        # keeps one 4-byte value on the stack under Triton 3.9's split form: 16 bytes at most, nothing more.
        allowed = 16 if kernel is gemv_triton._fp8_gemv_kernel and constants["BLOCK_K"] == 1024 else 0
        assert spills is None or spills <= allowed, (kernel.fn.__name__, constants.get("BLOCK_M"), spills)


def test_gemv_launch_by_kind_of_weight():
    """Grouped weights, tall weights (V4.1's Engram wkv) and the rest each take the launch the H200 sweep with no
    weight in L2 found fastest for them (docs/perf.md, pass 11)."""
    pytest.importorskip("triton")
    from dsinfer.ops.fp8_linear import gemv_triton

    assert gemv_triton.default_gemv(4096, 1) == gemv_triton.DEFAULT_GEMV
    assert gemv_triton.default_gemv(8192, 8) == gemv_triton.GROUPED_GEMV
    assert gemv_triton.default_gemv(25600, 1) == gemv_triton.TALL_GEMV
    assert gemv_triton.DEFAULT_GEMV.block_k == 1024 and gemv_triton.TALL_GEMV.block_k == 512
