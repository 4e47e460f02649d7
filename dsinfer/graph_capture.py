"""Recording a step into a CUDA graph: what the engine's decode graphs and the speculative step's graphs share."""

from __future__ import annotations

import torch


def capture_graph(forward, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Record ``forward()`` into a CUDA graph: two runs on a side stream first (compile the kernels, settle the
    allocator outside the capture), then the capture in ``pool`` (None: a new one; pass ``graph.pool()`` of an
    earlier graph to share memory between graphs that never run at once). Returns the graph and what the
    captured call returned (tensors the replays overwrite)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
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
