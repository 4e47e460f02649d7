"""Where a decode entry goes (``decode_entry_location``): the Triton kernel (in Triton's CPU interpreter; compiled
on CUDA) against the torch reference, equal to the last integer, and the reference against the definition."""

from __future__ import annotations

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops.compressor.reference import decode_entry_location

CASES = [  # (sequences, table width, per_block, with completion flags, table dtype, entry dtype)
    (1, 4, 16, True, torch.int32, torch.int64),
    (5, 3, 8, True, torch.int64, torch.int64),
    (7, 6, 64, False, torch.int32, torch.int64),  # ratio 1: every entry complete
    (3, 1, 4, True, torch.int32, torch.int32),  # entries past the table's width: its last column
    (33, 5, 2, False, torch.int64, torch.int32),
]
TRASH = 1000


def make_inputs(index: int, device: str):
    sequences, width, per_block, flagged, table_dtype, entry_dtype = CASES[index]
    gen = torch.Generator().manual_seed(index)
    tables = torch.randint(0, 500, (sequences, width), generator=gen).to(table_dtype)
    entry = torch.randint(0, per_block * width + 5, (sequences,), generator=gen).to(entry_dtype)
    complete = torch.rand(sequences, generator=gen) < 0.5 if flagged else None
    moved = [t.to(device) if t is not None else None for t in (tables, entry, complete)]
    return (*moved, per_block, TRASH)


def check(device: str) -> list[str]:
    from dsinfer.ops.compressor.location_triton import decode_entry_location_triton, serves

    failures = []
    for index in range(len(CASES)):
        args = make_inputs(index, device)
        if not serves(*args[:3]):
            failures.append(f"case {index}: the kernel does not take it")
            continue
        block, row = decode_entry_location_triton(*args)
        want_block, want_row = decode_entry_location(*args)
        if block.dtype != want_block.dtype or row.dtype != want_row.dtype:
            failures.append(f"case {index}: dtypes {block.dtype}, {row.dtype}")
        elif not (torch.equal(block, want_block) and torch.equal(row, want_row)):
            failures.append(f"case {index}: {block.tolist()}, {row.tolist()} != {want_block.tolist()}, {want_row}")
    return failures


def run_interpreted_cases() -> list[str]:
    return check("cpu")


def test_triton_kernel_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_entry_location")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
def test_triton_kernel_matches_reference_on_cuda():
    assert check("cuda") == []


def test_reference_sends_incomplete_entries_to_the_trash():
    tables = torch.tensor([[7, 8], [9, 10]])
    entry = torch.tensor([5, 1])
    block, row = decode_entry_location(tables, entry, torch.tensor([True, False]), 4, 99)
    assert block.tolist() == [8, 99] and row.tolist() == [1, 1]
    block, row = decode_entry_location(tables, entry, None, 4, 99)
    assert block.tolist() == [8, 9] and row.tolist() == [1, 1]
