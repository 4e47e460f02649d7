"""index_scores_paged: the reference against the former path (gather every slot's keys, decode, ``index_scores``),
and the Triton kernel (interpreted on the CPU; compiled on CUDA) against the reference on plain and FP4-coded key
pools: one sequence and a batch, visible counts of 0, inside a tile and at the table's end, block tables padded
with the spare block, 32 and 20 heads, bf16 and fp32 queries, and rows whose every head's ReLU is 0 (exact ties)."""

from __future__ import annotations

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops import registry
from dsinfer.ops.cache_codec.reference import cache_decode_reference, cache_encode_reference
from dsinfer.ops.fake_quant import fake_quant_index
from dsinfer.ops.index_scores.reference import index_scores_reference
from dsinfer.ops.index_scores_paged.reference import PagedIndexInputs, index_scores_paged_reference

CASES = [  # batch, heads, dim, per_block, table width, dtype
    (1, 32, 128, 64, 1, torch.bfloat16),
    (3, 32, 128, 32, 5, torch.bfloat16),
    (4, 20, 64, 8, 7, torch.float32),
    (2, 32, 32, 16, 3, torch.float32),
]


def make_inputs(batch, heads, dim, per_block, width, dtype, coded, generator):
    blocks = batch * width + 2
    pool = fake_quant_index(torch.randn(blocks, per_block, dim, generator=generator)).to(dtype)
    keys, scales = cache_encode_reference(pool, "e2m1", 32, "ue8m0") if coded else (pool, None)
    tables = torch.randperm(blocks - 1, generator=generator)[: batch * width].view(batch, width)
    tables[0, -1] = blocks - 1  # the spare block pads a table
    visible = torch.randint(0, width * per_block + 1, (batch,), generator=generator)
    visible[0] = 0 if batch > 1 else width * per_block
    q = fake_quant_index(torch.randn(batch, heads, dim, generator=generator)).to(dtype)
    if batch > 2:
        q[2] = -q[2].abs()  # with keys of both signs some products stay positive; weights below make ties
    weights = torch.randn(batch, heads, generator=generator) * heads**-0.5
    return q, weights, keys, scales, tables, visible


def check(device: torch.device) -> list[str]:
    import dsinfer.ops.index_scores_paged.triton as backend

    failures = []
    generator = torch.Generator().manual_seed(0)
    for case in CASES:
        for coded in (False, True):
            inputs = make_inputs(*case, coded, generator)
            inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
            label = f"{case} coded={coded}"
            if not backend.serves(inputs[0], inputs[2], inputs[3]):
                failures.append(f"{label}: the kernel does not take it")
                continue
            want = index_scores_paged_reference(PagedIndexInputs(*inputs))
            got = backend.index_scores_paged_triton(PagedIndexInputs(*inputs))
            finite = torch.isfinite(want)
            if got.shape != want.shape or not torch.equal(torch.isfinite(got), finite):
                failures.append(f"{label}: shape or -inf pattern differs")
                continue
            if not torch.equal(got[want == 0], want[want == 0]):
                failures.append(f"{label}: exact zeros differ")
            error = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
            if error > 1e-4 * max(1.0, want[finite].abs().max().item() if finite.any() else 1.0):
                failures.append(f"{label}: max |triton - reference| = {error:.3g}")
    return failures


def run_interpreted_cases() -> list[str]:
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()
    return check(torch.device("cpu")) + check_words(torch.device("cpu"))


@pytest.mark.parametrize("coded", [False, True])
def test_reference_is_the_former_gather_and_score(coded):
    generator = torch.Generator().manual_seed(1)
    for case in CASES:
        q, weights, keys, scales, tables, visible = make_inputs(*case, coded, generator)
        gathered = keys[tables] if scales is None else cache_decode_reference(
            keys[tables], scales[tables], "e2m1", 32, "ue8m0", case[-1]
        )  # fmt: skip
        want = index_scores_reference(q, gathered.flatten(1, 2), weights, visible)
        paged = PagedIndexInputs(q, weights, keys, scales, tables, visible)
        assert torch.equal(index_scores_paged_reference(paged), want)


def test_triton_kernel_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_index_scores_paged")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernel_matches_the_reference_on_cuda():
    assert check(torch.device("cuda")) == []


def test_registry_picks_the_kernel_on_cuda_only():
    assert [b.name for b in registry.backends("index_scores_paged")] == ["triton", "reference"]
    assert registry.choose("index_scores_paged", "cpu", torch.float32).name == "reference"


# The FP4 words layout (dsinfer/ops/index_scores_paged/fp4_words.py) against the reference: the stated bound of
# test_index_decode (float32 sums in another order, plus 2^-16 of each product's magnitude for float32 queries split
# into two bf16 halves) at 1 request (every tile and chunk edge, a case each) and 64 (the edges and random counts);
# its decode bit for bit against the codec's for every byte under every scale byte the codec writes; and the
# indexer's choice from its scores equal to the reference's on untied scores.
try:
    import triton
    import triton.language as tl

    from dsinfer.ops.index_scores_paged.fp4_words import _fp4_word_keys, fp4_word_channels

    @triton.jit
    def _decode_words_kernel(words_ptr, exponents_ptr, keys_ptr, n, NATIVE_BF16: tl.constexpr):
        """Each word's 8 keys (the words layout's column order) under its scale byte."""
        rows = tl.program_id(0) * 64 + tl.arange(0, 64)
        inside = rows < n
        words = tl.load(words_ptr + rows, mask=inside, other=0)[:, None]
        exponents = tl.load(exponents_ptr + rows, mask=inside, other=127).to(tl.int32)[:, None]
        keys = _fp4_word_keys(words, exponents << 7, NATIVE_BF16)
        tl.store(keys_ptr + rows[:, None] * 8 + tl.arange(0, 8)[None, :], keys, mask=inside[:, None])

    @triton.jit
    def _word_channels_kernel(channels_ptr):
        tl.store(channels_ptr + tl.arange(0, 8), fp4_word_channels(8))

except ImportError:  # pragma: no cover - depends on the install
    triton = None

WORDS_CASES = [  # batch, query dtype, heads, dim, slots a block (128, V4.1's: a tile's slots in one block)
    (1, torch.bfloat16, 16, 64, 16),
    (1, torch.float32, 20, 128, 16),
    (1, torch.bfloat16, 16, 64, 128),
    (64, torch.bfloat16, 16, 64, 16),
    (64, torch.bfloat16, 64, 128, 16),
    (64, torch.float32, 64, 128, 16),
    (64, torch.bfloat16, 64, 128, 128),
]


def check_words_layout(device: torch.device) -> list[str]:
    from test_index_decode import EDGES, ScoresCase, check_scores

    generator = torch.Generator().manual_seed(2)
    messages = []
    for batch, q_dtype, heads, dim, per_block in WORDS_CASES:
        case = ScoresCase(batch, "fp4", q_dtype, heads, dim, per_block)
        counts = [[edge] for edge in EDGES] if batch == 1 else [None]
        messages += [check_scores(case, device, generator, fp4_layout="words", visible=visible) for visible in counts]
    return [f"words: {message}" for message in messages if message]


def check_words_decode(device: torch.device) -> str | None:
    """Each packed byte, four times in a word, under each scale byte the codec writes: the words layout's keys
    against the codec reference's decode (float32 products, cast to bf16), bit for bit."""
    from test_index_scores_fp4 import codec_bytes

    from dsinfer.ops.triton_support import interpreted

    packed, exponents = codec_bytes()
    words = (packed.to(torch.int64) * 0x01010101).to(torch.int32).to(device)
    keys = torch.empty(packed.numel(), 8, dtype=torch.bfloat16, device=device)
    _decode_words_kernel[(triton.cdiv(packed.numel(), 64),)](words, exponents.to(device), keys, packed.numel(),
                                                            not interpreted())  # fmt: skip
    channels = torch.empty(8, dtype=torch.int32, device=device)
    _word_channels_kernel[(1,)](channels)
    codes = packed[:, None].expand(-1, 4).contiguous()
    want = cache_decode_reference(codes, exponents[:, None], "e2m1", 8, "ue8m0", torch.bfloat16)
    want = want[:, channels.cpu().long()].to(device)
    differs = keys.view(torch.int16) != want.view(torch.int16)
    if differs.any():
        row = int(differs.any(-1).nonzero()[0])
        return f"words decode of byte {int(packed[row])} under scale byte {int(exponents[row])}: {keys[row]}"
    return None


def check_words_choice(device: torch.device) -> list[str]:
    """The top-k of the words layout's scores is the reference's, 64 requests, k 8 and 100; a pipeline depth of
    the caller's (``words_launch``) replaces the default and gives the same scores."""
    from test_index_decode import make_inputs, visible_counts

    import dsinfer.ops.index_scores_paged.triton as backend
    from dsinfer.ops.index_select.reference import index_topk_decode_reference

    generator = torch.Generator().manual_seed(3)
    inputs = make_inputs(64, 64, 128, "fp4", torch.bfloat16, visible_counts(64, generator), generator)
    paged = PagedIndexInputs(*(t.to(device) for t in inputs))
    got = backend.paged_scores_launch(paged, chunk=128, fp4_layout="words")
    want = index_scores_paged_reference(paged)
    messages = []
    for k in (8, 100):
        if not torch.equal(index_topk_decode_reference(got, k), index_topk_decode_reference(want, k)):
            messages.append(f"words: another top-{k}")
    shallow = backend.paged_scores_launch(paged, chunk=128, fp4_layout="words", words_launch={"NUM_STAGES": 2})
    if not torch.equal(shallow, got):
        messages.append("words: two stages in flight changed the scores")
    return messages


def check_words(device: torch.device) -> list[str]:
    messages = check_words_layout(device) + check_words_choice(device)
    return messages + [message for message in [check_words_decode(device)] if message]


def test_fp4_words_layout_matches_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_index_scores_paged")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the interpreter test covers the CPU)")
def test_fp4_words_layout_matches_the_reference_on_cuda():
    assert check_words(torch.device("cuda")) == []


def words_kernel_signature(arg_names: list[str], constants: dict, q_pointer: str) -> dict:
    """An FP4 words scores kernel's argument types for an sm_90 build on the CPU: int32 words and scale rows, float32
    weights and scores, the query's ``q_pointer``, the other pointers int64, the integers int32."""
    pointers = {"q_ptr": q_pointer, "weights_ptr": "*fp32", "keys_ptr": "*i32", "scales_ptr": "*i32",
                "scores_ptr": "*fp32"}  # fmt: skip
    return {
        name: "constexpr" if name in constants else pointers.get(name, "*i64") if name.endswith("_ptr") else
        "fp32" if name == "scale" else "i32"
        for name in arg_names
    }  # fmt: skip


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_fp4_words_scores_kernel_compiles_for_hopper():
    """The default FP4 layout's kernel at V4.1's index-key shapes (64 heads x 128 channels, a ue8m0 byte per 32,
    128 entries a block, the scale row one int32) builds an sm_90 cubin without local memory."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import dsinfer.ops.index_scores_paged.fp4_words as words
    import dsinfer.ops.index_scores_paged.triton as backend

    kernel = words._words_scores_kernel
    constants = dict(PER_BLOCK=128, HEAD_DIM=128, SCALE_BLOCK=32, BLOCK_H=64, BLOCK_E=backend.BLOCK_E,
                     SPLIT_Q=False, NUM_STAGES=backend.WORDS_STAGES, NATIVE_BF16=True, SCALE_WORD=True,
                     TILE_IN_BLOCK=True)  # fmt: skip
    source = ASTSource(kernel, words_kernel_signature(kernel.arg_names, constants, "*bf16"), constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=backend.NUM_WARPS))
    assert compiled.asm["cubin"] and "ld.local" not in compiled.asm["ptx"]
    assert compiled.metadata.shared <= 227 * 1024
