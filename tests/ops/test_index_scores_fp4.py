"""The scores kernel's two FP4 tile layouts against the reference (interpreted on the CPU; compiled on CUDA).

``halves`` scores the even channels (low nibbles) and the odd ones (high nibbles) as two dots against the query's
even and odd channels, each nibble decoded straight to bf16 bits; ``joined`` interleaves the codes into one float32
tile first. Both must meet the stated bound of ``test_index_decode`` at 1 request (every tile and chunk edge, a case
each) and 64 (the edges and random counts), with bf16 and float32 queries; the integer decode must equal the codec
reference's decode bit for bit for all 16 codes under every scale byte the codec writes; and the inputs must be
able to tell the layouts' channel order apart (a kernel that swapped the halves would fail).
"""

from __future__ import annotations

import pytest
import torch
from interpreted import assert_interpreted_cases_pass
from test_index_decode import EDGES, ScoresCase, check_scores, make_inputs, score_bound

from dsinfer.kv.codecs import INDEX_KEY_FORMAT
from dsinfer.ops.cache_codec.reference import cache_decode_reference
from dsinfer.ops.index_scores_paged.reference import PagedIndexInputs, index_scores_paged_reference

try:
    import triton
    import triton.language as tl

    from dsinfer.ops.index_scores_paged.triton import e2m1_bf16, fp4_scale_fields

    @triton.jit
    def _decode_bytes_kernel(packed_ptr, exponents_ptr, even_ptr, odd_ptr, n, BLOCK: tl.constexpr):
        """Each packed byte's two nibbles under its scale byte, as the halves layout decodes them."""
        index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = index < n
        packed = tl.load(packed_ptr + index, mask=inside, other=0).to(tl.int32)
        exponent = tl.load(exponents_ptr + index, mask=inside, other=127).to(tl.int32)
        exponent_base, half_bits = fp4_scale_fields(exponent)
        tl.store(even_ptr + index, e2m1_bf16(packed & 0xF, exponent_base, half_bits), mask=inside)
        tl.store(odd_ptr + index, e2m1_bf16(packed >> 4, exponent_base, half_bits), mask=inside)

except ImportError:  # pragma: no cover - depends on the install
    triton = None

LAYOUTS = ("halves", "joined")
FP4_CASES = [
    ScoresCase(1, "fp4"),
    ScoresCase(1, "fp4", torch.float32, heads=20, dim=128),
    ScoresCase(64, "fp4"),
    ScoresCase(64, "fp4", torch.float32, heads=64, dim=128),
]
LARGEST_SCALE_BYTE = 253  # a block's amax < 2**128 gives at most 2**126 (byte 253), codes up to 4 under it
SMALLEST_SCALE_BYTE = 1  # the amax floor 6 * 2**-126 gives at least 2**-126


def codec_bytes() -> tuple[torch.Tensor, torch.Tensor]:
    """Every packed byte (two codes) under every scale byte the codec writes: bytes [N] and scale bytes [N]."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(LARGEST_SCALE_BYTE - SMALLEST_SCALE_BYTE + 1)
    exponents = torch.arange(SMALLEST_SCALE_BYTE, LARGEST_SCALE_BYTE + 1, dtype=torch.uint8).repeat_interleave(256)
    largest_code = torch.maximum(packed & 0x7, (packed >> 4) & 0x7)
    written = (exponents < LARGEST_SCALE_BYTE) | (largest_code <= 6)  # code 6 is the value 4
    return packed[written], exponents[written]


def check_decode(device: torch.device) -> str | None:
    """The integer bf16 decode against the codec reference's (float32 products, cast to bf16), bit for bit."""
    packed, exponents = (t.to(device) for t in codec_bytes())
    even = torch.empty(packed.shape, dtype=torch.bfloat16, device=device)
    odd = torch.empty_like(even)
    _decode_bytes_kernel[(triton.cdiv(packed.numel(), 1024),)](packed, exponents, even, odd, packed.numel(), 1024)
    want = cache_decode_reference(packed[:, None], exponents[:, None], "e2m1", 2, "ue8m0", torch.bfloat16)
    got = torch.stack([even, odd], dim=-1)
    differs = got.view(torch.int16) != want.view(torch.int16)
    if differs.any():
        row = int(differs.any(-1).nonzero()[0])
        return f"decode of byte {int(packed[row])} under scale byte {int(exponents[row])}: {got[row]} != {want[row]}"
    return None


def check_layouts(device: torch.device) -> list[str]:
    """Both layouts on every case; the single-request cases once per edge."""
    generator = torch.Generator().manual_seed(0)
    messages = []
    for layout in LAYOUTS:
        for case in FP4_CASES:
            counts = [[edge] for edge in EDGES] if case.batch == 1 else [None]
            for visible in counts:
                message = check_scores(case, device, generator, fp4_layout=layout, visible=visible)
                messages.append(message and f"{layout}: {message}")
    return [message for message in messages if message]


def check(device: torch.device) -> list[str]:
    return [message for message in [check_decode(device), *check_layouts(device)] if message]


def run_interpreted_cases() -> list[str]:
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()
    return check(torch.device("cpu"))


def test_fp4_layouts_match_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_index_scores_fp4")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the interpreter test covers the CPU)")
def test_fp4_layouts_match_the_reference_on_cuda():
    assert check(torch.device("cuda")) == []


def test_swapped_channel_halves_break_the_bound():
    """The FP4 cases can tell even channels from odd: keys whose nibbles are swapped (a kernel that paired the low
    nibbles with the odd query channels) score beyond the bound the layouts are held to."""
    generator = torch.Generator().manual_seed(0)
    for case in FP4_CASES:
        visible = [EDGES[-1]] * case.batch
        inputs = make_inputs(case.batch, case.heads, case.dim, case.form, case.q_dtype, visible, generator)
        want = index_scores_paged_reference(PagedIndexInputs(*inputs))
        keys = inputs[2]
        swapped = PagedIndexInputs(*inputs[:2], (keys << 4) | (keys >> 4), *inputs[3:])
        bound = 2.0**-16 * score_bound(inputs) + 1e-6 * (1 + want.abs())
        assert ((index_scores_paged_reference(swapped) - want).abs() > bound).any(), case


def test_unknown_fp4_layout_is_refused():
    pytest.importorskip("triton")
    from dsinfer.ops.index_scores_paged.triton import paged_scores_launch

    q = torch.zeros(1, 16, 64)
    keys, scales = INDEX_KEY_FORMAT.encode(torch.zeros(1, 16, 64))
    inputs = PagedIndexInputs(q, torch.ones(1, 16), keys, scales, torch.zeros(1, 1, dtype=torch.long), torch.ones(1))
    with pytest.raises(ValueError, match="fp4_layout"):
        paged_scores_launch(inputs, fp4_layout="interleaved")
