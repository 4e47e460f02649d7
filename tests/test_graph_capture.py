"""Which BLAS library a CUDA graph records its linears under, and that recording leaves torch's choice as it was."""

from __future__ import annotations

import pytest
import torch

from dsinfer.graph_capture import FLOAT32_FEW_ROWS, blas_for_rows, capture_graph, preferred_blas


def test_float32_products_of_few_rows_take_cublaslt():
    assert blas_for_rows(1, float32=True) == "cublas"  # one row: alike, torch's default kept
    assert blas_for_rows(2, float32=True) == "cublaslt"
    assert blas_for_rows(FLOAT32_FEW_ROWS, float32=True) == "cublaslt"
    assert blas_for_rows(FLOAT32_FEW_ROWS + 1, float32=True) == "cublas"
    assert blas_for_rows(4, float32=False) == "cublas"  # bf16 models: not measured, torch's default


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_recorded_under_cublaslt_replays_its_product_and_restores_the_choice():
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(256, 128, device="cuda", generator=generator)
    x = torch.randn(4, 128, device="cuda", generator=generator)
    before = torch.backends.cuda.preferred_blas_library()
    graph, out = capture_graph(lambda: torch.nn.functional.linear(x, weight), blas="cublaslt")
    assert torch.backends.cuda.preferred_blas_library() == before
    x.copy_(torch.randn(4, 128, device="cuda", generator=generator))
    graph.replay()
    with preferred_blas("cublaslt"):
        want = torch.nn.functional.linear(x, weight)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-4)
