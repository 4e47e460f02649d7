"""``copy_expert_rows``: the Triton kernel (in Triton's CPU interpreter; compiled on CUDA it reads pinned host memory
in place) against the torch reference, on byte rows and 8-byte word rows, with skipped entries and chunked rows."""

from __future__ import annotations

import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops.expert_fetch import as_rows, copy_expert_rows_reference


def cases():
    generator = torch.Generator().manual_seed(0)
    experts = torch.randint(0, 256, (6, 40, 33), dtype=torch.uint8, generator=generator)  # 1,320-byte rows
    words = torch.randint(0, 256, (5, 4096 * 9), dtype=torch.uint8, generator=generator)  # rows over two chunks
    return [
        ("byte rows, two skipped", as_rows(experts), 4, [3, -1, 0, -1], [1, 0, 3, 2]),
        ("word rows", as_rows(words), 3, [4, 2, -1], [2, 0, 1]),
        ("nothing to copy", as_rows(experts), 2, [-1, -1], [0, 1]),
    ]


def run_interpreted_cases() -> list[str]:
    from dsinfer.ops.expert_fetch.triton import copy_expert_rows_triton

    failures = []
    for name, source, targets, source_rows, target_rows in cases():
        target = torch.randint(0, 100, (targets, source.shape[1]), dtype=torch.int32).to(source.dtype)
        expected, got = target.clone(), target.clone()
        rows = torch.tensor(source_rows), torch.tensor(target_rows)
        copy_expert_rows_reference(source, expected, *rows)
        copy_expert_rows_triton(source, got, *rows, chunk_bytes=8192)
        if not torch.equal(got, expected):
            failures.append(f"{name}: the kernel's rows differ from the reference's")
    return failures


def test_reference_copies_the_named_rows_and_only_them():
    source = as_rows(torch.arange(4 * 16, dtype=torch.uint8).view(4, 16))
    target = torch.zeros(3, source.shape[1], dtype=source.dtype)
    copy_expert_rows_reference(source, target, torch.tensor([2, -1, 0]), torch.tensor([1, 2, 0]))
    assert torch.equal(target[1], source[2]) and torch.equal(target[0], source[0])
    assert not target[2].any()


def test_triton_kernel_matches_the_reference_interpreted():
    assert_interpreted_cases_pass("test_expert_fetch")
