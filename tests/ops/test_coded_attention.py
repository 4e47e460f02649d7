"""sparse_attention_decode_coded: the reference against V4's decode attention over the decoded cache (bit for bit),
and the Triton kernel (interpreted on the CPU; compiled on CUDA) in each of its decode forms against the reference
on random coded caches: one token, window-only layers, a window that wraps or starts after a prefix hit, no chosen
entry, entries split across tiles and splits, batch mixes, head counts that do not fill a group, fp32 and bf16."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hopper_build import register_spills
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops import registry
from dsinfer.ops.cache_codec.reference import cache_decode_reference, cache_encode_reference
from dsinfer.ops.coded_attention.reference import CodedDecodeInputs, sparse_attention_decode_coded_reference
from dsinfer.ops.fake_quant import fake_quant_compressed_kv, fake_quant_window_kv
from dsinfer.ops.sparse_attention.reference import SparseDecodeInputs, StepRows, sparse_attention_decode_reference


@dataclass(frozen=True)
class Case:
    positions: tuple[int, ...]
    window_from: tuple[int, ...] | None = None
    heads: int = 8
    dim: int = 64
    window: int = 16
    per_block: int = 4
    table_width: int = 5
    n_indices: int = 12
    invalid: float = 0.25
    entries: bool = True
    dtype: torch.dtype = torch.float32
    num_splits: int | None = None
    seed: int = 0
    spread: bool = False  # every scale block of a row at its own magnitude (a scale on wrong channels shows)
    hardware_fp8: bool | None = None  # the kernel's e4m3 decode: the float8 cast (True) or arithmetic (False)
    step: int = 0  # a verify step of this many rows a sequence, read from its own coded rows (the query's among them)


CASES = [
    Case(positions=(0,), entries=False),  # one token, the first of its sequence: one visible key
    Case(positions=(0,), n_indices=4, invalid=1.0),  # no chosen entry
    Case(positions=(5, 40), invalid=1.0, num_splits=3),  # no entry, several splits (most see nothing)
    Case(positions=(9,), window_from=(4,)),  # the ring's start after a prefix hit
    Case(positions=(15, 16, 17, 31), n_indices=9),  # wrap-around at the window boundary
    Case(positions=(3, 70, 129, 500, 12), window_from=(0, 60, 0, 490, 0), heads=20, seed=1),  # mixed; 20 % 16
    Case(positions=(100, 7), n_indices=40, num_splits=1, seed=3),  # one split finishes the sink itself
    Case(positions=(100, 7), n_indices=40, num_splits=4, seed=3),  # entries across splits and tiles
    Case(positions=(64, 2), window=32, entries=False, num_splits=2, seed=4),  # window-only, two splits
    Case(positions=(0,), entries=False, dtype=torch.bfloat16),
    Case(positions=(3, 70, 129), window_from=(0, 60, 0), heads=20, dim=128, dtype=torch.bfloat16, seed=5),
    Case(positions=(100, 7, 55), n_indices=33, num_splits=2, dtype=torch.bfloat16, seed=6),
    Case(positions=(40, 100), n_indices=20, num_splits=2, spread=True, seed=7),
    Case(positions=(40, 100), n_indices=20, num_splits=2, spread=True, hardware_fp8=False, seed=7),
    Case(positions=(70, 9), heads=16, dim=128, n_indices=24, spread=True, dtype=torch.bfloat16, seed=8),
    Case(positions=(15, 16, 17, 31, 2), window_from=(0, 3, 0, 0, 0), step=4, spread=True, seed=11),  # step rows
    Case(positions=(64, 3, 40), window=32, entries=False, num_splits=2, step=3, dtype=torch.bfloat16, seed=12),
]


def make_inputs(case: Case) -> dict:
    """A coded cache (rows rounded as V4.1 rounds them, then encoded) and a step, in the op's argument order."""
    gen = torch.Generator().manual_seed(case.seed)
    batch = len(case.positions)
    slot_count, block_count = batch + 2, batch * case.table_width + 3
    ring = torch.randn(slot_count, case.window, case.dim, generator=gen) * 3
    pool = torch.randn(block_count, case.per_block, case.dim, generator=gen)
    if case.spread:  # 2**-3 .. 2**4 by scale block, in an order that is not monotone in the channel
        channel = torch.arange(case.dim)
        ring = ring * 2.0 ** ((channel // 32 * 5) % 8 - 3).float()
        pool = pool * 2.0 ** ((channel // 16 * 3) % 8 - 3).float()
    ring = fake_quant_window_kv(ring)
    window_codes, window_scales = cache_encode_reference(ring, "e4m3", 32, "ue8m0")
    pool = fake_quant_compressed_kv(pool)
    entry_codes, entry_scales = cache_encode_reference(pool, "e2m1", 16, "e4m3")
    tables = torch.randperm(block_count, generator=gen)[: batch * case.table_width].view(batch, -1)
    indices = torch.randint(0, case.table_width * case.per_block, (batch, case.n_indices), generator=gen)
    drop = torch.rand(batch, case.n_indices, generator=gen) < case.invalid
    return {
        "q": torch.randn(batch, case.heads, case.dim, generator=gen).to(case.dtype),
        "window_codes": window_codes,
        "window_scales": window_scales,
        "slots": torch.randperm(slot_count, generator=gen)[:batch],
        "positions": torch.tensor(case.positions),
        "window_from": torch.tensor(case.window_from or (0,) * batch),
        "entry_codes": entry_codes if case.entries else None,
        "entry_scales": entry_scales if case.entries else None,
        "block_tables": tables,
        "indices": torch.where(drop, -1, indices) if case.entries else None,
        "sink": torch.randn(case.heads, generator=gen),
        "softmax_scale": case.dim**-0.5,
        "step": _step_rows(case, gen) if case.step else None,
    }


def _step_rows(case: Case, gen: torch.Generator) -> StepRows:
    """``case.step`` coded rows a sequence (rounded and encoded as the ring's); sequence ``b``'s query is row
    ``b % step`` of its step."""
    batch = len(case.positions)
    rows = fake_quant_window_kv(torch.randn(batch * case.step, case.dim, generator=gen) * 3)
    codes, scales = cache_encode_reference(rows, "e4m3", 32, "ue8m0")
    starts = torch.tensor(case.positions) - torch.arange(batch) % case.step
    return StepRows(codes, starts, torch.arange(batch) * case.step, scales)


def _on(inputs: dict, device) -> dict:
    """``inputs`` on ``device``, the step's tensors included."""
    out = {}
    for key, value in inputs.items():
        if isinstance(value, StepRows):
            value = StepRows(*(t.to(device) for t in (value.rows, value.starts, value.first_rows, value.scales)))
        elif isinstance(value, torch.Tensor):
            value = value.to(device)
        out[key] = value
    return out


def decoded(inputs: dict, dtype: torch.dtype) -> dict:
    """V4's op's arguments: the same step over the decoded ring and entry pool."""
    window = cache_decode_reference(inputs["window_codes"], inputs["window_scales"], "e4m3", 32, "ue8m0", dtype)
    entries = None
    if inputs["entry_codes"] is not None:
        entries = cache_decode_reference(inputs["entry_codes"], inputs["entry_scales"], "e2m1", 16, "e4m3", dtype)
    names = ("slots", "positions", "window_from", "block_tables", "indices", "sink", "softmax_scale")
    step = inputs["step"]
    if step is not None:
        rows = cache_decode_reference(step.rows, step.scales, "e4m3", 32, "ue8m0", dtype)
        step = StepRows(rows, step.starts, step.first_rows)
    return {"window": window, "entries": entries, "q": inputs["q"].to(dtype), "step": step,
            **{k: inputs[k] for k in names}}  # fmt: skip


def check_triton_case(case: Case, device: torch.device | None = None, decode: str | None = None) -> str | None:
    """The kernel (in form ``decode``; None: the launch's default) against the fp32 reference on the same inputs:
    2e-5 in fp32, in bf16 V4's 1.5e-2, each for outputs of magnitude up to 2 and relative beyond (the ring rows
    here reach 8, the spread case 36; both dtypes round the output relatively: in fp32 the spread case's error is
    3.8e-5 on some CPUs' interpreter, about 10 ulps at 36)."""
    import dsinfer.ops.coded_attention.triton as backend

    inputs = make_inputs(case)
    if device is not None:
        inputs = _on(inputs, device)
    if not backend.serves(inputs["q"], inputs["window_codes"], inputs["window_scales"], inputs["entry_codes"],
                          inputs["entry_scales"], inputs["indices"]):  # fmt: skip
        return f"{case}: the kernel does not take it"
    got = backend.sparse_attention_decode_coded_launch(CodedDecodeInputs(*inputs.values()), num_splits=case.num_splits,
                                                       hardware_fp8=case.hardware_fp8, decode=decode)  # fmt: skip
    if got.dtype != case.dtype or got.shape != inputs["q"].shape:
        return f"{case}: got {got.dtype} {tuple(got.shape)}"
    exact = sparse_attention_decode_coded_reference(CodedDecodeInputs(**{**inputs, "q": inputs["q"].float()}))
    error = (got.float() - exact).abs().max().item()
    limit = (2e-5 if case.dtype == torch.float32 else 1.5e-2) * max(1.0, exact.abs().max().item() / 2)
    return None if error <= limit else f"{case} {decode}: max |triton - reference| = {error:.3g} > {limit}"


try:
    import triton
    import triton.language as tl

    from dsinfer.ops.cache_codec.triton import e4m3_value
    from dsinfer.ops.coded_attention.triton import e2m1_scaled, e4m3_decode

    @triton.jit
    def _decode_all_codes(codes_ptr, cast_ptr, arithmetic_ptr, nibbles_ptr):
        byte = tl.load(codes_ptr + tl.arange(0, 256))
        tl.store(cast_ptr + tl.arange(0, 256), e4m3_decode(byte, True))
        tl.store(arithmetic_ptr + tl.arange(0, 256), e4m3_value(byte.to(tl.int32)))
        tl.store(nibbles_ptr + tl.arange(0, 16), e2m1_scaled(tl.arange(0, 16).to(tl.uint8)))
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def check_code_decoders(device: torch.device | None = None) -> str | None:
    """The kernel's decoders on every code: the float8 cast of each of the 254 non-NaN e4m3fn bytes against the
    arithmetic :func:`e4m3_value` and torch's float8 (bit for bit, -0 included), and ``e2m1_scaled`` of each of
    the 16 e2m1 nibbles against ``2**-14`` times the e2m1 values (-0 included)."""
    from dsinfer.ops.quant import E2M1_VALUES

    codes = torch.arange(256, dtype=torch.uint8, device=device)
    cast, arithmetic = torch.empty(256, device=device), torch.empty(256, device=device)
    nibbles = torch.empty(16, device=device)
    _decode_all_codes[(1,)](codes, cast, arithmetic, nibbles)
    finite = torch.tensor([c not in (0x7F, 0xFF) for c in range(256)], device=device)
    want = codes.view(torch.float8_e4m3fn).float()
    for name, got in (("float8 cast", cast), ("arithmetic", arithmetic)):
        if not torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32)):
            return f"e4m3 by the {name}: {got[finite]} != {want[finite]}"
    e2m1 = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device) * 2.0**-14
    if not torch.equal(nibbles.view(torch.int32), e2m1.view(torch.int32)):
        return f"e2m1_scaled: {nibbles} != {e2m1}"
    return None


def run_interpreted_cases() -> list[str]:
    """Every case in the decode form ``DSINFER_CODED_ATTENTION_DECODE`` names (the launch reads it)."""
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()
    failures = [message for case in CASES if (message := check_triton_case(case)) is not None]
    return failures + [message for message in [check_code_decoders()] if message is not None]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_reference_is_v4_decode_attention_over_the_decoded_cache(case):
    inputs = make_inputs(case)
    want = sparse_attention_decode_reference(SparseDecodeInputs(**decoded(inputs, case.dtype)))
    assert torch.equal(sparse_attention_decode_coded_reference(CodedDecodeInputs(**inputs)), want)


DECODES = ("once", "twice")  # the kernel's forms (DECODES of its module)


@pytest.mark.parametrize("decode", DECODES)
def test_triton_kernel_matches_the_reference_in_the_interpreter(decode, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("DSINFER_CODED_ATTENTION_DECODE", decode)  # the interpreter's process inherits it
    assert_interpreted_cases_pass("test_coded_attention")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decode", DECODES)
def test_triton_kernel_matches_the_reference_on_cuda(decode):
    device = torch.device("cuda")
    assert [m for case in CASES if (m := check_triton_case(case, device, decode)) is not None] == []


def test_decode_form_comes_from_the_environment(monkeypatch):
    triton_backend = pytest.importorskip("dsinfer.ops.coded_attention.triton")
    assert triton_backend.DECODES == DECODES
    monkeypatch.delenv("DSINFER_CODED_ATTENTION_DECODE", raising=False)
    assert triton_backend.decode_form() == triton_backend.DECODE == "once"
    monkeypatch.setenv("DSINFER_CODED_ATTENTION_DECODE", "twice")
    assert triton_backend.decode_form() == "twice"
    monkeypatch.setenv("DSINFER_CODED_ATTENTION_DECODE", "thrice")
    with pytest.raises(ValueError, match="DSINFER_CODED_ATTENTION_DECODE"):
        triton_backend.decode_form()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_code_decoders_on_cuda():
    assert check_code_decoders(torch.device("cuda")) is None


def test_registry_picks_the_kernel_on_cuda_only():
    assert [b.name for b in registry.backends("sparse_attention_decode_coded")] == ["triton", "reference"]
    assert registry.choose("sparse_attention_decode_coded", "cpu", torch.bfloat16).name == "reference"


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernel_compiles_for_hopper():
    """sm_90 cubins with Triton's bundled ptxas (no GPU needed) at V4-Flash shapes (64 heads x 512, window 128,
    top-k 512) in the configurations choose_config picks for bf16 at 1 and 32 sequences, the float8 cast on and
    pointers and strides 16-divisible as the launch specializes them, in every decode form: within the H200's
    227 KiB of shared memory per block and without register spills; the once form decodes each tile once (one
    float8 cast of the ring's codes, one of the entries' scales and one float16 bitcast per nibble in the TTGIR,
    where ``twice`` has each per product)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import dsinfer.ops.coded_attention.triton as backend
    from dsinfer.ops.sparse_attention.triton import choose_config

    kernel = backend._coded_split_kernel
    codes = ("window_ptr", "window_scales_ptr", "entries_ptr", "entry_scales_ptr", "step_codes_ptr", "step_scales_ptr")
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name.isupper():
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            kind = "bf16" if name in ("q_ptr", "out_ptr") else "u8" if name in codes else "fp32"
            signature[name] = "*" + ("fp32" if "part" in name or "sink" in name else kind)
            if name in ("slots_ptr", "positions_ptr", "window_from_ptr", "tables_ptr", "indices_ptr", "step_starts_ptr",
                        "step_first_ptr"):  # fmt: skip
                signature[name] = "*i64"
        else:
            signature[name] = "fp32" if name == "scale_log2" else "i32"
        if name.endswith("_ptr") or (name.startswith("stride_") and name != "stride_tb"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    # plain decode steps at one sequence, verify steps (step rows) at 32
    for batch, decode in ((batch, decode) for batch in (1, 32) for decode in DECODES):
        config = choose_config(64, torch.bfloat16, 512, batch)
        constants = dict(WINDOW=128, WINDOW_TILES=128 // config.block_n, PER_BLOCK=64, HEAD_DIM=512,
                         WINDOW_BLOCK=32, ENTRY_BLOCK=16, BLOCK_H=config.block_h, BLOCK_N=config.block_n, SPLITS=4,
                         HAS_ENTRIES=True, HAS_STEP=batch > 1, PRECISION="tf32", HARDWARE_FP8=True, DECODE=decode,
                         PIN=True)  # fmt: skip
        source = ASTSource(kernel, signature, constexprs=constants, attrs=attrs)
        options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        assert compiled.asm["cubin"] and "ld.local" not in compiled.asm["ptx"], (batch, decode)
        assert compiled.metadata.shared <= 227 * 1024, (batch, decode, compiled.metadata.shared)
        assert register_spills(compiled.asm["cubin"]) in (0, None), (batch, decode)
        casts = [line for line in compiled.asm["ttgir"].splitlines() if "tt.bitcast" in line]
        fp8, fp16 = (sum(f"x{kind}," in line.split("->")[-1] for line in casts) for kind in ("f8E4M3FN", "f16"))
        assert decode == "twice" or (fp8, fp16) == (2, 2), (batch, decode, fp8, fp16)
