"""``greedy_argmax``: the two-pass Triton kernel (in Triton's CPU interpreter; compiled on CUDA) against
``torch.argmax``, exactly: the lowest column on ties across and within chunks, NaN first, rows of -inf, odd
widths, strided rows, no rows."""

from __future__ import annotations

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops.argmax.reference import greedy_argmax_reference


def cases() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)

    def scores(rows: int, vocab: int, dtype=torch.bfloat16) -> torch.Tensor:
        return (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)

    ties = scores(3, 9000)
    ties[0, [7000, 3000, 8999]] = 50.0  # equal maxima in three chunks: the lowest column wins
    ties[1, [2049, 2050, 2047]] = 50.0  # across a chunk boundary and within a chunk
    ties[2] = 1.0  # every column ties
    special = scores(4, 5000, torch.float32)
    special[0, 4500] = float("nan")  # a NaN beats a larger number before it
    special[0, 10] = 1e30
    special[1] = float("-inf")  # nothing but -inf: the first column
    special[2, [4999, 2100]] = float("nan")  # two NaNs in two chunks: the first
    special[3, :] = float("-inf")
    special[3, 4999] = -1e30  # the last column, the only finite one
    wide = scores(2, 6000 + 37)[:, 37:]  # rows strided wider than the vocabulary
    return [
        ("one token, the model's vocabulary", scores(1, 129280)),
        ("a batch, fp16", scores(5, 4097, torch.float16)),
        ("float32, one column", scores(3, 1, torch.float32)),
        ("a chunk and one", scores(2, 2049)),
        ("ties", ties),
        ("NaN and -inf", special),
        ("strided rows", wide),
        ("no rows", scores(0, 300)),
    ]


def check(device: str) -> list[str]:
    from dsinfer.ops.argmax.triton import greedy_argmax_triton

    failures = []
    for name, scores in cases():
        got = greedy_argmax_triton(scores.to(device)).cpu()
        want = greedy_argmax_reference(scores)
        if got.dtype != torch.int64 or not torch.equal(got, want):
            failures.append(f"{name}: got {got.tolist()[:8]} ({got.dtype}), want {want.tolist()[:8]}")
    return failures


def run_interpreted_cases() -> list[str]:
    return check("cpu")


def test_triton_argmax_matches_torch_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_greedy_argmax")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
def test_triton_argmax_matches_torch_on_cuda():
    assert check("cuda") == []


def test_the_cases_exercise_the_tie_and_nan_rules():
    """The cases are built so that a kernel taking the last maximum, or ignoring NaN, would differ."""
    found = {name: greedy_argmax_reference(scores).tolist() for name, scores in cases()}
    assert found["ties"] == [3000, 2047, 0]
    assert found["NaN and -inf"] == [4500, 0, 2100, 4999]
