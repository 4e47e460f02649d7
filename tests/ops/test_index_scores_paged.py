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
    return check(torch.device("cpu"))


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
