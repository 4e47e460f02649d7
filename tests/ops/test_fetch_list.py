"""``offload_fetch_list``: the one-program Triton kernel (in Triton's CPU interpreter) against the torch reference,
as a layer's stage and as a fetch ahead, with repeated ids, experts already fetched ahead, and more ids than one
loop step reads; and the reference against the bookkeeping written out by hand."""

from __future__ import annotations

import pytest
import torch
from hopper_build import compile_for_hopper
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops.fetch_list import FetchListInputs, offload_fetch_list_reference


def _inputs(experts: int, offloaded: int, ids: torch.Tensor, ahead: bool, seed: int) -> FetchListInputs:
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(experts, generator=generator)
    resident = torch.zeros(experts, dtype=torch.bool)
    resident[order[offloaded:]] = True
    prefetched = (torch.rand(experts, generator=generator) < 0.3) & ~resident
    row_of_expert = torch.full((experts,), -1, dtype=torch.int64)
    row_of_expert[order[:offloaded]] = torch.randperm(offloaded, generator=generator)
    return FetchListInputs(
        expert_ids=ids, resident=resident, prefetched=prefetched, offloaded_ids=order[:offloaded].sort().values,
        row_of_expert=row_of_expert, counters=torch.randint(0, 50, (4,), generator=generator),
        counts=None if ahead else torch.randint(0, 9, (experts,), generator=generator),
        marks=torch.randint(0, 3, (experts,), dtype=torch.int32, generator=generator), ahead=ahead,
    )  # fmt: skip


def cases():
    generator = torch.Generator().manual_seed(1)
    return [
        ("stage, one token", 256, 51, torch.tensor([[3, 7, 200, 31, 90, 11]]), False),
        ("ahead, one token", 256, 51, torch.tensor([[3, 7, 200, 31, 90, 11]]), True),
        ("stage, repeated ids", 16, 6, torch.tensor([[1, 1, 2], [2, 9, 1]]), False),
        ("stage, a prefill chunk", 384, 300, torch.randint(0, 384, (700, 6), generator=generator), False),
        ("ahead, a prefill chunk", 384, 300, torch.randint(0, 384, (700, 6), generator=generator), True),
        ("stage, nothing offloaded chosen", 8, 2, torch.tensor([[0, 0]]), False),
    ]


def _state(inputs: FetchListInputs) -> list[torch.Tensor]:
    return [inputs.prefetched, inputs.counters] + ([] if inputs.counts is None else [inputs.counts])


def run_interpreted_cases() -> list[str]:
    from dsinfer.ops.fetch_list.triton import offload_fetch_list_launch

    failures = []
    for index, (name, experts, offloaded, ids, ahead) in enumerate(cases()):
        expected, got = _inputs(experts, offloaded, ids, ahead, index), _inputs(experts, offloaded, ids, ahead, index)
        rows = offload_fetch_list_reference(expected)
        kernel_rows = offload_fetch_list_launch(got)
        if not torch.equal(kernel_rows, rows):
            failures.append(f"{name}: fetch list {kernel_rows.tolist()} != {rows.tolist()}")
        for which, (a, b) in enumerate(zip(_state(got), _state(expected), strict=True)):
            if not torch.equal(a, b):
                failures.append(f"{name}: state {which} differs")
    return failures


def test_triton_kernel_matches_the_reference_interpreted():
    assert_interpreted_cases_pass("test_fetch_list")


@pytest.mark.parametrize("ahead", [False, True])
def test_reference_bookkeeping_by_hand(ahead):
    inputs = _inputs(8, 4, torch.tensor([[1, 5], [5, 6]]), ahead, seed=3)
    resident, prefetched = inputs.resident.tolist(), inputs.prefetched.tolist()
    counters, counts = inputs.counters.clone(), None if ahead else inputs.counts.clone()
    rows = offload_fetch_list_reference(inputs).tolist()
    chosen = {1, 5, 6}
    need = {e for e in chosen if not resident[e] and (ahead or not prefetched[e])}
    expected_rows = [int(inputs.row_of_expert[e]) if e in need else -1 for e in inputs.offloaded_ids.tolist()]
    assert rows == expected_rows
    assert inputs.prefetched.tolist() == [e in need if ahead else False for e in range(8)]
    if ahead:
        assert inputs.counters.tolist() == [*counters[:2].tolist(), *(counters[2:] + len(need)).tolist()]
    else:
        served = sum(resident[e] for e in chosen)
        assert inputs.counters.tolist() == (counters + torch.tensor([3, served, len(need), 0])).tolist()
        assert inputs.counts.tolist() == (counts + torch.bincount(torch.tensor([1, 5, 5, 6]), minlength=8)).tolist()


def test_counts_belong_to_the_stage_alone():
    inputs = _inputs(8, 4, torch.tensor([[1]]), ahead=True, seed=0)
    with pytest.raises(ValueError, match="counts are kept by the stage"):
        counted = {**inputs.__dict__, "counts": torch.zeros(8, dtype=torch.int64)}
        offload_fetch_list_reference(FetchListInputs(**counted))


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
@pytest.mark.parametrize("ahead", [False, True], ids=["stage", "ahead"])
def test_kernel_compiles_for_hopper(ahead):
    """An sm_90 cubin (Triton's bundled ptxas, no GPU needed) at V4.1-Flash's 384 experts, both modes."""
    pytest.importorskip("triton")
    import dsinfer.ops.fetch_list.triton as backend

    pointers = {"ids_ptr": "*i64", "resident_ptr": "*i8", "prefetched_ptr": "*i8", "offloaded_ptr": "*i64",
                "row_of_expert_ptr": "*i64", "counters_ptr": "*i64", "counts_ptr": "*i64", "marks_ptr": "*i32",
                "out_ptr": "*i64"}  # fmt: skip
    constants = dict(BLOCK_E=512, BLOCK_I=backend.BLOCK_IDS, AHEAD=ahead)
    options = dict(num_warps=backend.NUM_WARPS, num_stages=1)
    compiled = compile_for_hopper(backend._fetch_list_kernel, pointers, constants, options)
    assert compiled.asm["cubin"] and "ld.local" not in compiled.asm["ptx"]
