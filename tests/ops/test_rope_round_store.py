"""``rope_round_store``: a decode step's row chain (norm, RoPE, V4.1 rounding) and its cache write in one kernel
(Triton's interpreter on the CPU, compiled on CUDA), against the two ops it joins (``rope_and_round`` then
``cache_store``): the pools must hold the same bytes as after the two ops' Triton backends and as after their
references, wherever ``rope_and_round``'s kernel is bit for bit the reference's and itself: in bf16, or without a
norm. In float32 a norm's sum of squares may be added in another order (the fused kernel takes one row a program,
``rope_and_round``'s up to sixteen; on the H200 97 of the bytes of five 128-channel rows differed in their last
bits), so there the rows stored must be within the norm's tolerance of the two Triton ops', and coded rows, where
a last-bit difference can cross a rounding boundary, must have at least 99% of their bytes equal.

The cases are the step's writes: V4.1's window K=V (norm, FP8 rounding in blocks of 32, stored as e4m3 codes with
ue8m0 scales, in a ring: the modulus), compressed entries (FP4 with e4m3 scales in blocks of 16) and index keys
(norm, FP4 with ue8m0 scales in blocks of 32), each in model-dtype storage too, and V4's ``kv_norm`` and RoPE into
its ring; rows contiguous or the columns of a wider GEMM output, one token's angles or each row's own; 0, 1 and 5
rows (distinct pool rows, as the cache writes). A pool the kernel does not take runs the two ops' backends.
"""

from __future__ import annotations

import pytest
import torch
from hopper_build import cuobjdump
from interpreted import assert_interpreted_cases_pass
from test_rope_round import make_inputs

from dsinfer.ops import registry
from dsinfer.ops.cache_codec.reference import CacheStoreInputs, cache_store_reference
from dsinfer.ops.rope_round import RowChain, rope_round_store_reference
from dsinfer.ops.rope_round.reference import RopeRoundInputs, RopeRoundStoreInputs, rope_and_round_reference

POOL_ROWS = (6, 16)  # pool [first, second, width]
# (dim, has weight, rounding, block, (element, code_block, scale) or None for model-dtype storage, modulus)
WRITES = (
    (512, True, "fp8", 32, ("e4m3", 32, "ue8m0"), 16),  # V4.1 window K=V into the ring
    (512, False, "fp4_e4m3", 16, ("e2m1", 16, "e4m3"), None),  # V4.1 compressed entries
    (128, True, "fp4_ue8m0", 32, ("e2m1", 32, "ue8m0"), None),  # V4.1 index keys
    (512, True, "fp8", 32, None, 16),  # the window K=V in model-dtype storage
    (128, True, None, 0, None, None),  # rounding off
    (512, True, None, 0, None, 16),  # V4's kv_norm and RoPE into its ring
)
ROWS = (0, 1, 5)
DTYPES = (torch.bfloat16, torch.float32)
LAYOUTS = ("contiguous", "columns", "shared")


def make_pool(dim: int, dtype: torch.dtype, store, device):
    """An empty pool (and scale pool) of the write's format, filled with a byte no write gives."""
    if store is None:
        return torch.full((*POOL_ROWS, dim), 7.0, dtype=dtype, device=device), None
    element, code_block, scale = store
    width = dim if element == "e4m3" else dim // 2
    data = torch.full((*POOL_ROWS, width), 0x5A, dtype=torch.uint8, device=device)
    scales = torch.full((*POOL_ROWS, dim // code_block), 0x5A, dtype=torch.uint8, device=device)
    data = data.view(torch.float8_e4m3fn) if element == "e4m3" else data
    return data, scales.view(torch.float8_e4m3fn) if scale == "e4m3" else scales


def check_cases(device: torch.device) -> list[str]:
    import dsinfer.ops.rope_round.store_triton as backend

    failures = []
    generator = torch.Generator().manual_seed(3)
    for rows in ROWS:
        for dim, has_weight, rounding, block, store, modulus in WRITES:
            for dtype in DTYPES:
                for layout in LAYOUTS:
                    label = f"rows={rows} dim={dim} {rounding}/{block} store={store} {dtype} {layout}"
                    x, cos, sin, weight = make_inputs(rows, (), dim, 64, has_weight, dtype, layout, generator, device)
                    first = torch.randperm(POOL_ROWS[0], generator=generator)[:rows].to(device)
                    second = torch.randperm(POOL_ROWS[1], generator=generator)[:rows]
                    second = (second + (3 * POOL_ROWS[1] if modulus else 0)).to(device)  # positions past the ring
                    element, code_block, scale = store if store is not None else (None, 0, None)
                    pools = [make_pool(dim, dtype, store, device) for _ in range(3)]
                    chain = RopeRoundInputs(x, cos, sin, weight, 1e-6, rounding, block)
                    where = (first, second, modulus, element, code_block, scale)
                    if not backend.fused_store_takes(RopeRoundStoreInputs.of(chain, *pools[1], *where)):
                        failures.append(f"{label}: the kernel does not take it")
                        continue
                    backend.rope_round_store_triton(RopeRoundStoreInputs.of(chain, *pools[1], *where))
                    unfused = backend.rope_and_round_triton(chain)
                    backend.cache_store_triton(CacheStoreInputs(unfused, *pools[2], *where))
                    if dtype == torch.float32 and weight is not None:
                        failures += _close(label, pools[2], pools[1])
                        continue
                    rope_round_store_reference(RopeRoundStoreInputs.of(chain, *pools[0], *where))
                    for name, truth in (("the two Triton ops", pools[2]), ("the reference", pools[0])):
                        for want, got in zip(truth, pools[1], strict=True):
                            if want is not None and not torch.equal(want.view(torch.uint8), got.view(torch.uint8)):
                                differ = (want.view(torch.uint8) != got.view(torch.uint8)).sum().item()
                                failures.append(f"{label}: {differ} pool bytes differ from {name}")
    failures += _fallback_cases(device, generator)
    return failures


def _fallback_cases(device: torch.device, generator: torch.Generator) -> list[str]:
    """A pool the kernel does not take (a column slice of a wider one) still gets the reference's rows, through
    ``rope_and_round`` then ``cache_store``."""
    import dsinfer.ops.rope_round.store_triton as backend

    x, cos, sin, weight = make_inputs(3, (), 128, 64, True, torch.bfloat16, "columns", generator, device)
    first, second = torch.tensor([1, 3, 0], device=device), torch.tensor([0, 2, 2], device=device)
    pools = [torch.zeros(4, 3, 256, dtype=torch.bfloat16, device=device) for _ in range(2)]
    where = (first, second, None, None, 0, None)
    chain = RopeRoundInputs(x, cos, sin, weight, 1e-6, "fp8", 32)
    if backend.fused_store_takes(RopeRoundStoreInputs.of(chain, pools[1][:, :, :128], None, *where)):
        return ["fallback: the kernel takes a pool that is not contiguous"]
    rope_round_store_reference(RopeRoundStoreInputs.of(chain, pools[0][:, :, :128], None, *where))
    backend.rope_round_store_triton(RopeRoundStoreInputs.of(chain, pools[1][:, :, :128], None, *where))
    if not torch.equal(pools[0], pools[1]) or not pools[1].any():
        return ["fallback: the pool differs from the reference's"]
    return []


def _close(label: str, want: tuple, got: tuple) -> list[str]:
    """A float32 chain with a norm: rows within the norm's tolerance (model-dtype storage), or at least 99% of the
    code and scale bytes equal (coded storage)."""
    (want_data, want_scales), (got_data, _) = want, got
    if want_scales is None:
        if not ((got_data - want_data).abs() <= (want_data.abs() + 8) * 2**-22).all():
            return [f"{label}: max |diff| from the two Triton ops {(got_data - want_data).abs().max():.3g}"]
        return []
    equal = torch.cat([(w.view(torch.uint8) == g.view(torch.uint8)).flatten() for w, g in zip(want, got, strict=True)])
    if equal.float().mean().item() < 0.99:
        return [f"{label}: only {equal.float().mean().item():.3f} of the bytes equal the two Triton ops'"]
    return []


def run_interpreted_cases() -> list[str]:
    """Every case through the interpreter (TRITON_INTERPRET=1 must be set before Triton loads)."""
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()  # the interpreter's float32 -> bf16 cast truncates: round to nearest even
    return check_cases(torch.device("cpu"))


def test_triton_rope_round_store_matches_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_rope_round_store")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_rope_round_store_matches_on_cuda():
    assert check_cases(torch.device("cuda")) == []


def test_registry_picks_reference_on_cpu_and_triton_on_cuda():
    assert registry.choose("rope_round_store", "cpu", torch.float32).name == "reference"
    if torch.cuda.is_available():
        assert registry.choose("rope_round_store", "cuda", torch.bfloat16).name == "triton"


def test_reference_is_rope_and_round_then_cache_store():
    generator = torch.Generator().manual_seed(4)
    x, cos, sin, weight = make_inputs(3, (), 128, 64, True, torch.bfloat16, "contiguous", generator, "cpu")
    store = ("e2m1", 32, "ue8m0")
    first, second = torch.tensor([0, 2, 5]), torch.tensor([1, 9, 4])
    pools = [make_pool(128, torch.bfloat16, store, "cpu") for _ in range(2)]
    rope_round_store_reference(
        RopeRoundStoreInputs.of(
            RopeRoundInputs(x, cos, sin, weight, 1e-6, "fp4_ue8m0", 32), *pools[0], first, second, None, *store
        )
    )
    rows = rope_and_round_reference(RopeRoundInputs(x, cos, sin, weight, 1e-6, "fp4_ue8m0", 32))
    cache_store_reference(CacheStoreInputs(rows, *pools[1], first, second, None, *store))
    for want, got in zip(pools[0], pools[1], strict=True):
        assert torch.equal(want, got)
    assert not torch.equal(pools[0][0], make_pool(128, torch.bfloat16, store, "cpu")[0])  # the write happened


def test_row_chain_runs_its_op_table():
    """A :class:`RowChain` computes its rows and stores them through the table it carries."""
    generator = torch.Generator().manual_seed(5)
    x, cos, sin, weight = make_inputs(2, (), 512, 64, True, torch.float32, "contiguous", generator, "cpu")
    ops = registry.resolve(torch.device("cpu"), torch.float32)
    chain = RowChain(ops, RopeRoundInputs(x, cos, sin, weight, 1e-6, "fp8", 32))
    assert chain.shape == x.shape
    assert torch.equal(chain.rows(), rope_and_round_reference(RopeRoundInputs(x, cos, sin, weight, 1e-6, "fp8", 32)))
    pool = torch.zeros(2, 4, 512)
    chain.store(pool, None, torch.tensor([1, 0]), torch.tensor([2, 3]), None, None, 0, None)
    assert torch.equal(pool[1, 2], chain.rows()[0]) and torch.equal(pool[0, 3], chain.rows()[1])


def test_pools_the_kernel_does_not_take_are_refused():
    """A pool that is not contiguous is not the kernel's (``check_cases`` stores into one through the fallback)."""
    import dsinfer.ops.rope_round.store_triton as backend

    generator = torch.Generator().manual_seed(6)
    x, cos, sin, weight = make_inputs(2, (), 64, 32, True, torch.float32, "contiguous", generator, "cpu")
    pool = torch.zeros(4, 3, 128)[:, :, :64]  # a column slice: not contiguous
    first, second = torch.tensor([1, 3]), torch.tensor([0, 2])
    assert not backend.fused_store_takes(
        RopeRoundStoreInputs.of(
            RopeRoundInputs(x, cos, sin, weight, 1e-6), pool, None, first, second, None, None, 0, None
        )
    )


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernel_compiles_for_hopper_in_the_models_writes():
    """The interpreter never compiles: build the store kernel to sm_90 cubins (Triton's bundled ptxas, no GPU) in
    the writes a V4.1 decode step makes, coded and in model dtype, at the warps the store launches with, without
    register spills: no local loads or stores in the machine code (the FP4 / e4m3 scale search's divisions call a
    slow-path routine, whose return address alone gives the kernel an 8-byte stack)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import dsinfer.ops.rope_round.store_triton as backend
    from dsinfer.ops.cache_codec.triton import encoding_kind
    from dsinfer.ops.norm_rope.rms_norm_triton import norm_launch_shape
    from dsinfer.ops.norm_rope.row_chain_triton import KINDS

    kernel = backend._chain_store_kernel
    for dim, has_weight, rounding, block, store, modulus in WRITES:
        pointers = {"src": "*bf16", "weight": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                    "data_ptr": "*bf16" if store is None else "*u8", "scales_ptr": "*u8", "first_ptr": "*i64",
                    "second_ptr": "*i64"}  # fmt: skip
        signature = {
            name: "constexpr" if name.isupper() else pointers.get(name, "fp32" if name == "eps" else "i64")
            for name in kernel.arg_names
        }
        row_block, _, warps = norm_launch_shape(dim)
        warps = backend.store_warps(dim) or warps
        constants = dict(NOPE=dim - 64, NORM=int(has_weight), KIND=KINDS[rounding], QUANT_BLOCK=max(block, 1),
                         ROWS=backend.ROWS_PER_PROGRAM, BLOCK=row_block,
                         ENCODE=-1 if store is None else encoding_kind(*store),
                         CODE_BLOCK=1 if store is None else store[1], HAS_MODULUS=modulus is not None)  # fmt: skip
        source = ASTSource(kernel, signature, constexprs=constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        label = (dim, rounding, store)
        assert compiled.asm["cubin"] and "ld.local" not in compiled.asm["ptx"], label
        sass = cuobjdump(compiled.asm["cubin"], "-sass")
        assert sass is None or not any(f" {op}" in sass for op in ("STL", "LDL")), label


def test_store_warps_take_wide_rows_at_eight_and_a_checked_override(monkeypatch):
    """Rows of 512 channels or more store from eight-warp programs, narrower ones at the norm kernels' choice;
    ``DSINFER_STORE_WARPS`` overrides both and refuses what is not a power of two from 1 to 16."""
    pytest.importorskip("triton")
    from dsinfer.ops.rope_round.store_triton import WIDE_ROW_WARPS, store_warps

    monkeypatch.delenv("DSINFER_STORE_WARPS", raising=False)
    assert (store_warps(512), store_warps(1024), store_warps(128)) == (WIDE_ROW_WARPS, WIDE_ROW_WARPS, None)
    monkeypatch.setenv("DSINFER_STORE_WARPS", "2")
    assert (store_warps(512), store_warps(128)) == (2, 2)
    for setting in ("3", "32", "eight"):
        monkeypatch.setenv("DSINFER_STORE_WARPS", setting)
        with pytest.raises(ValueError, match="DSINFER_STORE_WARPS"):
            store_warps(512)
