"""index_topk_decode and candidate_block_mask: the Triton kernels (interpreted on the CPU; compiled on CUDA) against
the references, bit for bit, and the references against the selections the V4.1 layer made inline before.

Cases: one row and many, widths that are and are not powers of two and that do not fill the last block, k wider
than the row, ties (exact zeros, as the indexer's ReLU gives, -0 beside +0, repeated values), rows with fewer
finite scores than k, rows with none, an ``allowed`` mask, and visible counts of 0, inside and at the end; and
candidate masks of rows wider than one program holds (a 131,072-entry source's).
"""

from __future__ import annotations

import pytest
import torch
from hopper_build import compile_for_hopper, registers_and_stack
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops import registry
from dsinfer.ops.index_scores.reference import top_k_in_order
from dsinfer.ops.index_select.reference import candidate_block_mask_reference, index_topk_decode_reference

SHAPES = ((1, 1), (1, 7), (3, 64), (5, 100), (2, 320), (4, 1000))
KS = (1, 6, 64, 512)


def make_scores(rows: int, width: int, generator: torch.Generator, flavour: str) -> torch.Tensor:
    """float32 scores: "random", "ties" (few distinct values, zeros of both signs), "hidden" (a causal -inf tail
    of random length per row, some rows all -inf)."""
    scores = torch.randn(rows, width, generator=generator)
    if flavour == "ties":
        scores = torch.tensor([0.0, -0.0, 1.5, -2.0, 1.5, 0.25])[
            torch.randint(0, 6, (rows, width), generator=generator)
        ]
    if flavour == "hidden":
        visible = torch.randint(0, width + 1, (rows, 1), generator=generator)
        visible[0] = 0
        scores = scores.masked_fill(torch.arange(width) >= visible, float("-inf"))
    return scores


def cases(generator: torch.Generator):
    for rows, width in SHAPES:
        for flavour in ("random", "ties", "hidden"):
            yield make_scores(rows, width, generator, flavour), flavour


def check(device: torch.device) -> list[str]:
    import dsinfer.ops.index_select.triton as backend

    failures = []
    generator = torch.Generator().manual_seed(0)
    for scores, flavour in cases(generator):
        rows, width = scores.shape
        allowed = torch.rand(rows, width, generator=generator) < 0.6
        scores, allowed = scores.to(device), allowed.to(device)
        for k in KS:
            for mask in (None, allowed):
                label = f"topk {tuple(scores.shape)} {flavour} k={k} allowed={mask is not None}"
                want = index_topk_decode_reference(scores, k, mask)
                got = backend.index_topk_decode_triton(scores, k, mask)
                if got.dtype != want.dtype or not torch.equal(got, want):
                    failures.append(f"{label}: differs")
        for block_size in (4, 8):
            for topk_blocks in (1, 3, 2048):
                counts = torch.randint(0, width + 1, (rows,), generator=generator)
                counts[-1] = width
                counts = counts.to(device)
                label = f"candidates {tuple(scores.shape)} {flavour} block={block_size} top={topk_blocks}"
                want = candidate_block_mask_reference(scores, counts, topk_blocks, block_size)
                got = backend.candidate_block_mask_triton(scores, counts, topk_blocks, block_size)
                if got.dtype != want.dtype or not torch.equal(got, want):
                    failures.append(f"{label}: differs")
    return failures + check_wide_candidates(device, generator)


WIDE_CANDIDATE_CASES = [  # rows, width, block size, blocks kept: rows wider than one program (MAX_WIDTH) holds
    (3, 16385, 4, 3),
    (3, 16385, 8, 2048),
    (2, 131075, 8, 2048),  # a 131,072-token ratio-1 source's row (and a last block it does not fill)
]


def check_wide_candidates(device: torch.device, generator: torch.Generator) -> list[str]:
    """``candidate_block_mask`` of rows too wide for one program (its blocks chosen by the chunked selection)."""
    import dsinfer.ops.index_select.triton as backend

    failures = []
    for rows, width, block_size, topk_blocks in WIDE_CANDIDATE_CASES:
        assert backend.triton.next_power_of_2(-(-width // block_size)) * block_size > backend.MAX_WIDTH
        for flavour in ("random", "ties", "hidden"):
            scores = make_scores(rows, width, generator, flavour)
            counts = torch.randint(1, width + 1, (rows,), generator=generator)
            counts[0], counts[-1] = (0 if flavour == "hidden" else 1), width
            scores, counts = scores.to(device), counts.to(device)
            want = candidate_block_mask_reference(scores, counts, topk_blocks, block_size)
            got = backend.candidate_block_mask_triton(scores, counts, topk_blocks, block_size)
            if got.dtype != want.dtype or not torch.equal(got, want):
                failures.append(f"wide candidates {(rows, width)} {flavour} block={block_size} top={topk_blocks}")
    return failures


def run_interpreted_cases() -> list[str]:
    return check(torch.device("cpu"))


def test_reference_is_the_layers_former_selection():
    generator = torch.Generator().manual_seed(1)
    for scores, _ in cases(generator):
        chosen, real = top_k_in_order(scores, 6)
        assert torch.equal(index_topk_decode_reference(scores, 6), torch.where(real, chosen, -1))


def test_triton_kernels_match_the_references_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_index_select")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernels_match_the_references_on_cuda():
    assert check(torch.device("cuda")) == []


def test_registry_picks_the_kernels_on_cuda_only():
    for op in ("index_topk_decode", "candidate_block_mask"):
        assert [b.name for b in registry.backends(op)] == ["triton", "reference"]
        assert registry.choose(op, "cpu", torch.float32).name == "reference"


CAPPED_STACK_BYTES = 64  # what Triton 3.9's build of a capped program may spill (3.6, the GPU image's, and 3.8: none)
POINTERS = {"scores_ptr": "*fp32", "allowed_ptr": "*u8", "out_ptr": "*i32", "kept_ptr": "*u32", "entries_ptr": "*i32"}


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("program", ["chunk", "merge", "wide_merge"])
def test_selection_programs_compile_for_hopper(program):
    """The programs of a long row at their launches (a 4,096-key chunk, candidates kept, and the merge of up to
    4,096 or 8,192 candidates) build sm_90 cubins without local memory (the interpreter runs code the compiler can
    refuse); a program the register cap applies to stays within it (three 8-warp programs a multiprocessor) and
    spills at most a few values."""
    pytest.importorskip("triton")
    import dsinfer.ops.index_select.triton as backend

    if program == "chunk":
        kernel, constants, block = backend._topk_kernel, dict(HAS_ALLOWED=False, KEEP_KEYS=True), backend.CHUNK
        constants["BLOCK_W"] = block
    else:
        block = backend.CHUNK if program == "merge" else 2 * backend.CHUNK
        kernel, constants = backend._merge_kernel, dict(BLOCK_C=block)
    warps = backend._warps(block)
    cap = backend._register_cap(warps)
    assert bool(cap) == (warps <= backend.CAPPED_WARPS)
    compiled = compile_for_hopper(kernel, POINTERS, constants, dict(num_warps=warps, **cap))
    assert compiled.asm["cubin"] and "ld.local" not in compiled.asm["ptx"]
    usage = registers_and_stack(compiled.asm["cubin"])
    if usage is not None and cap:
        registers, stack = usage
        assert registers <= backend.REGISTER_CAP and stack <= CAPPED_STACK_BYTES, usage
