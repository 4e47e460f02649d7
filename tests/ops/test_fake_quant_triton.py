"""V4.1's fake quantization and cache codecs: the Triton kernels (interpreted on the CPU) against the references.

Every kernel must equal its reference bit for bit: rounded values (``fake_quant_fp8``, ``fake_quant_fp4`` with
e4m3 and ue8m0 scales), stored bytes (``cache_encode``: codes and scales of all three cache formats) and decoded
rows (``cache_decode``). The inputs cover what rounding is sensitive to: exact midpoints between codes (ties to
even), negative zeros and tiny negatives, blocks under the amax floors, all-zero blocks, e4m3-subnormal scales
(where the e4m3 rule is not idempotent and the encoder must search), large magnitudes, one row and many, and the
layouts the model rounds ([T, 512] KV rows, [B, H, 128] indexer queries, a non-contiguous view).
"""

from __future__ import annotations

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops import registry
from dsinfer.ops.cache_codec.reference import CacheStoreInputs, cache_decode_reference, cache_encode_reference
from dsinfer.ops.fake_quant.reference import fake_quant_fp4, fake_quant_fp8

DTYPES = (torch.bfloat16, torch.float32, torch.float16)
SHAPES = ((1, 512), (5, 512), (3, 4, 128), (2, 64))
FORMATS = (("e4m3", 32, "ue8m0"), ("e2m1", 16, "e4m3"), ("e2m1", 32, "ue8m0"))  # window KV, entries, index keys


def make_values(shape, dtype, generator, flavour: str) -> torch.Tensor:
    """Random rows of one ``flavour``: "normal", "wide" (magnitudes over many binades), "edges" (midpoints,
    zeros, tiny blocks), "tiny" (blocks near or under the amax floors)."""
    x = torch.randn(*shape, generator=generator)
    if flavour == "wide":
        x = x * torch.exp2(torch.randint(-12, 9, shape, generator=generator).float())
    elif flavour == "edges":
        grid = torch.tensor([0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -2.5, 1e-30, -1e-30, 7.0])
        x = grid[torch.randint(0, len(grid), shape, generator=generator)]
        x[..., :16] = 0.0  # a whole zero block (under every floor)
        x[..., 16:32] = -0.0
    elif flavour == "tiny":
        x = x * 2.0**-10
    return x.to(dtype)


def flavours():
    return ("normal", "wide", "edges", "tiny")


def check_fake_quant(device: torch.device) -> list[str]:
    import dsinfer.ops.fake_quant.triton as backend

    failures = []
    generator = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        for dtype in DTYPES:
            for flavour in flavours():
                x = make_values(shape, dtype, generator, flavour).to(device)
                cases = [
                    ("fp8/32", fake_quant_fp8(x, 32), backend.fake_quant_fp8_triton(x, 32)),
                    ("fp4/16/e4m3", fake_quant_fp4(x, 16, True), backend.fake_quant_fp4_triton(x, 16, True)),
                    ("fp4/32/ue8m0", fake_quant_fp4(x, 32, False), backend.fake_quant_fp4_triton(x, 32, False)),
                ]
                for name, want, got in cases:
                    label = f"{name} {tuple(shape)} {dtype} {flavour}"
                    if got.dtype != want.dtype or got.shape != want.shape:
                        failures.append(f"{label}: got {got.dtype} {tuple(got.shape)}")
                    elif not torch.equal(got, want) or _sign_bits(got) != _sign_bits(want):
                        failures.append(f"{label}: {(got != want).sum().item()} elements differ")
    x = make_values((6, 1024), torch.bfloat16, generator, "normal").to(device)[:, ::2]  # a strided view
    if not torch.equal(backend.fake_quant_fp8_triton(x, 32), fake_quant_fp8(x, 32)):
        failures.append("fp8 of a strided view differs")
    return failures


def _sign_bits(t: torch.Tensor) -> int:
    """How many elements carry the sign bit (torch.equal calls -0 and +0 equal; the rounding keeps the sign)."""
    return int(torch.signbit(t).sum())


def check_cache_codec(device: torch.device) -> list[str]:
    import dsinfer.ops.cache_codec.triton as backend

    failures = []
    generator = torch.Generator().manual_seed(1)
    for element, block, scale in FORMATS:
        for shape in SHAPES:
            for dtype in (torch.bfloat16, torch.float32):
                for flavour in flavours():
                    for on_grid in (True, False):
                        x = make_values(shape, dtype, generator, flavour)
                        if on_grid:  # what the cache stores: rows the fake quantizer rounded
                            x = (
                                fake_quant_fp8(x, block)
                                if element == "e4m3"
                                else fake_quant_fp4(x, block, scale == "e4m3")
                            )
                        if flavour == "tiny" and element == "e2m1" and scale == "e4m3":
                            x = x * 2.0**-4  # e4m3-subnormal scales: the rule's scale is not always exact
                        x = x.to(device)
                        label = f"{element}/{block}/{scale} {tuple(shape)} {dtype} {flavour} grid={on_grid}"
                        want_codes, want_scales = cache_encode_reference(x, element, block, scale)
                        got_codes, got_scales = backend.cache_encode_triton(x, element, block, scale)
                        if (got_codes.dtype, got_scales.dtype) != (want_codes.dtype, want_scales.dtype):
                            failures.append(f"{label}: encode dtypes {got_codes.dtype}, {got_scales.dtype}")
                            continue
                        if not torch.equal(got_codes.view(torch.uint8), want_codes.view(torch.uint8)):
                            failures.append(f"{label}: codes differ")
                        if not torch.equal(got_scales.view(torch.uint8), want_scales.view(torch.uint8)):
                            failures.append(f"{label}: scales differ")
                        for out_dtype in (torch.bfloat16, torch.float32):
                            want = cache_decode_reference(  # on the CPU: the truth, not CUDA's float8 cast
                                want_codes.cpu(), want_scales.cpu(), element, block, scale, out_dtype
                            ).to(device)
                            got = backend.cache_decode_triton(want_codes, want_scales, element, block, scale, out_dtype)
                            if (
                                got.dtype != want.dtype
                                or not torch.equal(got, want)
                                or _sign_bits(got) != _sign_bits(want)
                            ):
                                failures.append(f"{label}: decode to {out_dtype} differs")
    return failures


def searched_rows(rows: int, width: int, block: int, generator: torch.Generator) -> torch.Tensor:
    """FP4 rows whose e4m3 scales the encoder must search for: each block is ``c`` (an e4m3 value) times e2m1
    values, its amax ``4c`` or ``2c``. The rule's scale, ``amax / 6`` rounded to e4m3, is then mostly not exact,
    while ``amax / 4`` is."""
    shape = (rows, width // block, block)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    amax = torch.where(torch.rand(*shape[:2], 1, generator=generator) < 0.5, 4.0, 2.0)
    values = torch.minimum(grid[torch.randint(0, len(grid), shape, generator=generator)], amax)
    values[..., :1] = amax  # the amax, at the block's first channel
    sign = torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0)
    mantissa = 1.0 + torch.randint(0, 8, (*shape[:2], 1), generator=generator).float() / 8
    c = mantissa * torch.exp2(torch.randint(-6, 5, (*shape[:2], 1), generator=generator).float())
    return (values * sign * c).reshape(rows, width)


def check_lossless_search(device: torch.device) -> list[str]:
    """FP4 / e4m3 encoding of :func:`searched_rows`: the reference's codes and scales bit for bit, where most
    blocks' scales are not the rule's (so a search that stops at the rule, or tries the candidates in another
    order or with other values, fails)."""
    import dsinfer.ops.cache_codec.triton as backend

    x = searched_rows(6, 512, 16, torch.Generator().manual_seed(5))
    want_codes, want_scales = cache_encode_reference(x, "e2m1", 16, "e4m3")
    amax = x.view(6, 32, 16).abs().amax(dim=-1)
    rule = (amax / 6).to(torch.float8_e4m3fn)
    searched = float((want_scales.view(torch.uint8) != rule.view(torch.uint8)).float().mean())
    failures = [] if searched > 0.5 else [f"only {searched:.0%} of the blocks need the search"]
    got_codes, got_scales = backend.cache_encode_triton(x.to(device), "e2m1", 16, "e4m3")
    for name, want, got in (("codes", want_codes, got_codes), ("scales", want_scales, got_scales)):
        if not torch.equal(want.view(torch.uint8), got.cpu().view(torch.uint8)):
            failures.append(f"lossless search: {name} differ")
    return failures


def check_cache_store(device: torch.device) -> list[str]:
    """``cache_store``: the same pool bytes as the reference's encode-and-scatter, plain and coded, with and
    without the ring's modulus, one row and several (distinct rows, as the cache writes)."""
    import dsinfer.ops.cache_codec.triton as backend
    from dsinfer.ops.cache_codec.reference import cache_store_reference

    failures = []
    generator = torch.Generator().manual_seed(2)
    for fmt in ((None, 0, None), *FORMATS):
        element, block, scale = fmt
        for rows, modulus in ((1, None), (5, 16), (3, None)):
            values = fake_quant_fp8(make_values((rows, 128), torch.bfloat16, generator, "normal"), 32)
            width = 128 if element in (None, "e4m3") else 64
            dtype = torch.bfloat16 if element is None else (torch.float8_e4m3fn if element == "e4m3" else torch.uint8)
            pools = []
            for _ in range(2):
                data = torch.zeros(6, 16, width, dtype=torch.uint8).view(dtype) if element else torch.zeros(6, 16, 128)
                data = data.to(torch.bfloat16) if element is None else data
                scale_dtype = torch.float8_e4m3fn if scale == "e4m3" else torch.uint8
                scales = None if element is None else torch.zeros(6, 16, 128 // block, dtype=torch.uint8)
                pools.append((data.to(device), None if scales is None else scales.view(scale_dtype).to(device)))
            first = torch.randperm(6, generator=generator)[:rows].to(device)
            second = (torch.randperm(16, generator=generator)[:rows] + (40 if modulus else 0)).to(device)
            args = (first, second, modulus, element, block, scale)
            cache_store_reference(CacheStoreInputs(values.to(device), *pools[0], *args))
            backend.cache_store_triton(CacheStoreInputs(values.to(device), *pools[1], *args))
            for want, got in zip(pools[0], pools[1], strict=True):
                if want is not None and not torch.equal(want.view(torch.uint8), got.view(torch.uint8)):
                    failures.append(f"cache_store {fmt} rows={rows} modulus={modulus}: pool bytes differ")
    return failures


def run_interpreted_cases() -> list[str]:
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()  # the interpreter's float32 -> bf16 cast truncates: round to nearest even
    cpu = torch.device("cpu")
    return check_fake_quant(cpu) + check_cache_codec(cpu) + check_cache_store(cpu) + check_lossless_search(cpu)


def test_triton_fake_quant_and_cache_codecs_match_the_references_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_fake_quant_triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_fake_quant_and_cache_codecs_match_the_references_on_cuda():
    cuda = torch.device("cuda")
    assert (
        check_fake_quant(cuda) + check_cache_codec(cuda) + check_cache_store(cuda) + check_lossless_search(cuda) == []
    )


def test_registry_picks_the_kernels_on_cuda_only():
    for op in ("fake_quant_fp8", "fake_quant_fp4", "cache_encode", "cache_decode", "cache_store"):
        assert [b.name for b in registry.backends(op)][0] == "triton"
        assert registry.choose(op, "cpu", torch.bfloat16).name == "reference"
