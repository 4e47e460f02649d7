"""The routed experts' combine (``sum_slots``): each token's k slot rows summed in float32 in slot order, rounded
once (Triton's interpreter on the CPU, compiled on CUDA); in bf16 on CUDA also bit for bit torch's
``view(T, k, H).sum(1)``, which the engine ran before (torch's float32 sum on CUDA takes another order)."""

from __future__ import annotations

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

CASES = ((1, 6, 4096), (5, 6, 100), (37, 8, 1536), (3, 2, 2048), (0, 6, 64))  # tokens, top_k, hidden


def check_cases(device: torch.device, exact: bool) -> list[str]:
    from dsinfer.ops.moe.combine_triton import sum_slots

    failures = []
    generator = torch.Generator().manual_seed(0)
    for tokens, top_k, hidden in CASES:
        for dtype in (torch.bfloat16, torch.float32):
            slots = (torch.randn(tokens * top_k, hidden, generator=generator) * 3).to(dtype).to(device)
            want = slots.view(tokens, top_k, hidden).sum(dim=1)
            got = sum_slots(slots, tokens, top_k)
            label = f"T={tokens} k={top_k} H={hidden} {dtype}"
            if got.shape != want.shape or got.dtype != want.dtype:
                failures.append(f"{label}: got {got.dtype} {tuple(got.shape)}")
            elif exact and dtype == torch.bfloat16 and not torch.equal(got, want):
                failures.append(f"{label}: {(got != want).sum().item()} elements differ from torch's sum")
            else:  # the sum of float32 values in slot order, rounded once (torch's float32 sum takes another order)
                rows = slots.view(tokens, top_k, hidden).float()
                truth = rows[:, 0]
                for j in range(1, top_k):
                    truth = truth + rows[:, j]
                truth = truth.to(dtype)
                if not torch.equal(got, truth):
                    failures.append(f"{label}: not the slot-order float32 sum")
    return failures


def run_interpreted_cases() -> list[str]:
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()  # the interpreter's float32 -> bf16 cast truncates: round to nearest even
    return check_cases(torch.device("cpu"), exact=False)


def test_sum_slots_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_moe_combine")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sum_slots_equals_torch_sum_on_cuda():
    assert check_cases(torch.device("cuda"), exact=True) == []
