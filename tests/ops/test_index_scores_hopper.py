"""The Gluon FP4 scores kernel (dsinfer/ops/index_scores_paged/fp4_hopper.py) against the reference.

Triton's interpreter does not run Gluon, so the kernel is checked where it runs, on an sm_90 GPU: the stated bound
of ``test_index_decode`` (float32 sums in another order, plus 2^-16 of each product's magnitude for float32 queries
split into two bf16 halves) at 1 request on both sides of every tile and chunk edge and at 64 requests, with bf16
and float32 queries and 16, 20 and 64 heads, in blocks of 128 and of 64 keys (V4.1's ratio-1 and ratio-2
sources); keys and queries whose magnitudes span 2^-60 to 2^60 (every block of 32 channels its own scale byte),
where the one multiply a code pair and the query's power of two must keep every product exact; and the indexer's
top-k from its scores equal to the reference's on untied scores. Each case first asserts that the Gluon kernel
takes it, so a fallback to the Triton words kernel cannot pass for it. On the CPU the kernel is built for sm_90
with Triton's own ptxas.
"""

from __future__ import annotations

import pytest
import torch
from test_index_decode import CHUNK, EDGES, ScoresCase, check_scores, make_inputs, score_bound, visible_counts

from dsinfer.ops.index_scores_paged.reference import PagedIndexInputs, index_scores_paged_reference
from dsinfer.ops.index_select.reference import index_topk_decode_reference

PER_BLOCK = 128  # V4.1's ratio-1 index keys a block (128 positions): every 64-slot tile inside one
CASE_BLOCKS = (PER_BLOCK, 64)  # and its ratio-2 source's, one tile a block
CASES = [  # batch, query dtype, heads
    (1, torch.bfloat16, 64),
    (1, torch.float32, 20),
    (64, torch.bfloat16, 64),
    (64, torch.float32, 64),
    (64, torch.bfloat16, 16),
]


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def taken(inputs: list) -> bool:
    from dsinfer.ops.index_scores_paged.fp4_hopper import hopper_words_fits

    return hopper_words_fits(PagedIndexInputs(*inputs), CHUNK)


def check_cases(device: torch.device) -> list[str]:
    generator = torch.Generator().manual_seed(5)
    messages = []
    for (batch, q_dtype, heads), per_block in ((case, size) for case in CASES for size in CASE_BLOCKS):
        case = ScoresCase(batch, "fp4", q_dtype, heads, 128, per_block)
        sample = make_inputs(batch, heads, 128, "fp4", q_dtype, [0] * batch, generator, per_block)
        if not taken([t.to(device) for t in sample]):
            messages.append(f"{case}: the Gluon kernel does not take it")
            continue
        counts = [[edge] for edge in EDGES] if batch == 1 else [None]
        messages += [check_scores(case, device, generator, fp4_layout="words_mma", visible=seen) for seen in counts]
    return [f"words_mma: {message}" for message in messages if message]


def wide_magnitudes(device: torch.device, generator) -> list:
    """64 sequences of FP4 keys whose 32-channel blocks each sit at their own power of two in [2^-60, 2^60], and
    queries scaled by their own power of two in [2^-30, 2^30]."""
    from dsinfer.kv.codecs import INDEX_KEY_FORMAT

    inputs = make_inputs(64, 64, 128, "fp4", torch.bfloat16, visible_counts(64, generator), generator, PER_BLOCK)
    pool = torch.randn(inputs[2].shape[0], PER_BLOCK, 128, generator=generator)
    powers = torch.randint(-60, 61, (*pool.shape[:2], 4), generator=generator).float()
    pool = pool * torch.exp2(powers).repeat_interleave(32, dim=-1)
    inputs[2], inputs[3] = INDEX_KEY_FORMAT.encode(pool)
    query_powers = torch.randint(-30, 31, (64, 1, 1), generator=generator).float()
    inputs[0] = (inputs[0].float() * torch.exp2(query_powers)).bfloat16()
    return [t.to(device) for t in inputs]


def check_wide_magnitudes(device: torch.device) -> str | None:
    from dsinfer.ops.index_scores_paged.triton import paged_scores_launch

    inputs = wide_magnitudes(device, torch.Generator().manual_seed(6))
    if not taken(inputs):
        return "wide magnitudes: the Gluon kernel does not take it"
    want = index_scores_paged_reference(PagedIndexInputs(*inputs))
    got = paged_scores_launch(PagedIndexInputs(*inputs), chunk=CHUNK, fp4_layout="words_mma")
    finite = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), finite):
        return "wide magnitudes: the -inf pattern differs"
    bound = 2.0**-16 * score_bound(inputs) + 1e-6 * (1 + want.abs())
    excess = ((got - want).abs() - bound)[finite]
    return f"wide magnitudes: beyond the bound by {excess.max().item():.3g}" if (excess > 0).any() else None


def check_choice(device: torch.device) -> list[str]:
    """The top-k of the kernel's scores is the reference's (64 requests, k 8 and 100), and a shallower pipeline
    gives the same scores."""
    from dsinfer.ops.index_scores_paged.triton import paged_scores_launch

    generator = torch.Generator().manual_seed(7)
    inputs = make_inputs(64, 64, 128, "fp4", torch.bfloat16, visible_counts(64, generator), generator, PER_BLOCK)
    paged = PagedIndexInputs(*(t.to(device) for t in inputs))
    got = paged_scores_launch(paged, chunk=CHUNK, fp4_layout="words_mma")
    want = index_scores_paged_reference(paged)
    messages = [
        f"words_mma: another top-{k}"
        for k in (8, 100)
        if not torch.equal(index_topk_decode_reference(got, k), index_topk_decode_reference(want, k))
    ]
    shallow = paged_scores_launch(paged, chunk=CHUNK, fp4_layout="words_mma", words_launch={"NUM_STAGES": 2})
    if not torch.equal(shallow, got):
        messages.append("words_mma: two stages in flight changed the scores")
    return messages


@pytest.mark.skipif(not hopper(), reason="needs an sm_90 GPU (Gluon's warpgroup MMA; the interpreter cannot run it)")
def test_hopper_words_kernel_matches_the_reference():
    messages = check_cases(torch.device("cuda")) + check_choice(torch.device("cuda"))
    wide = check_wide_magnitudes(torch.device("cuda"))
    assert messages + ([wide] if wide else []) == []


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("split_q", [False, True])
def test_hopper_words_kernel_compiles_for_hopper(split_q):
    """The kernel at V4.1's index-key shapes (64 heads x 128 channels, 128 entries a block) builds an sm_90 cubin
    without local memory, its decoded tile reaching the MMA without a layout conversion."""
    pytest.importorskip("triton")
    import dsinfer.ops.index_scores_paged.fp4_hopper as hopper_words

    if hopper_words.gluon is None:
        pytest.skip("this Triton has no Gluon Hopper language")
    import triton
    from test_index_scores_paged import words_kernel_signature
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = hopper_words._hopper_words_kernel
    constants = dict(PER_BLOCK=PER_BLOCK, BLOCK_H=64, SPLIT_Q=split_q, NUM_STAGES=hopper_words.NUM_STAGES)
    signature = words_kernel_signature(kernel.arg_names, constants, "*fp32" if split_q else "*bf16")
    source = GluonASTSource(kernel, signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    assert compiled.asm["cubin"] and "ld.local" not in compiled.asm["ptx"]
    assert "wgmma.mma_async" in compiled.asm["ptx"] and "ldmatrix" not in compiled.asm["ptx"]
    assert compiled.metadata.shared <= 227 * 1024
