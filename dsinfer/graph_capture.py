"""Recording a step into a CUDA graph: what the engine's decode graphs and the speculative step's graphs share.

A graph keeps the GEMM kernels chosen while it was recorded, so each graph records under the BLAS library that
serves its row count best (:func:`blas_for_rows`): float32 products of 2 to ``FLOAT32_FEW_ROWS`` rows take
cuBLASLt, everything else cuBLAS, torch's default. On an H100 (``benchmarks/fp32_linear_blas.py``, the embedded
default's weight shapes) cuBLAS takes 5-7 us a call at 4 rows and 25-52 us at 16 for the 128- to 256-wide weights
where cuBLASLt takes 2.3-3.2; at 20 rows cuBLASLt is the slower one (11-15 us against 4.5-9.6), at 64 as slow or
slower, and at one row they are alike. The choice follows the engine's ``dtype``, the one its model was loaded in.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

FLOAT32_FEW_ROWS = 16  # the most rows a float32 product takes cuBLASLt for


def blas_for_rows(rows: int, float32: bool) -> str:
    """The BLAS library a graph whose linears multiply ``rows`` rows records under (``float32``: the model's
    linears are float32)."""
    return "cublaslt" if float32 and 1 < rows <= FLOAT32_FEW_ROWS else "cublas"


@contextmanager
def preferred_blas(library: str):
    """torch's preferred BLAS library set to ``library`` inside the block, the previous one restored after."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def capture_graph(forward, pool=None, blas: str = "cublas") -> tuple[torch.cuda.CUDAGraph, object]:
    """Record ``forward()`` into a CUDA graph: two runs on a side stream first (compile the kernels, settle the
    allocator outside the capture), then the capture in ``pool`` (None: a new one; pass ``graph.pool()`` of an
    earlier graph to share memory between graphs that never run at once), all under the BLAS library ``blas``.
    Returns the graph and what the captured call returned (tensors the replays overwrite)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with preferred_blas(blas):
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            output = forward()
    return graph, output


def release_graphs(device: torch.device, *tables: dict) -> None:
    """Drop the graphs of ``tables`` (each a dict of graphs, emptied) once no replay of them still runs on
    ``device``, and hand their memory pool back to the device, so that graphs recorded again next do not hold a
    second pool beside the old one (the profiles' recording again, where 256 x 131,072 leaves little room)."""
    torch.cuda.synchronize(device)
    for table in tables:
        table.clear()
    torch.cuda.empty_cache()
