"""``--cold`` for the GPU microbenchmarks: the calls of a timed CUDA graph cycle through copies of what they read.

A graph that calls one op on one weight (or one cache) ten times reads everything under the H200's 50 MB of L2
from L2 after its first call, which a model's decode step never does: between two reads of a layer's weights
every other layer's bytes pass. With ``--cold`` a benchmark gives the calls of its graph copies of what they read
(``with_copies``), enough copies that their reads add up to ``COLD_BYTES`` (``copy_count``), and the graph takes
them in turn (``cycle_graph``), so each call reads its bytes from HBM. Used by ``fp8_linear_choice.py``,
``moe_kernel.py --decode-gemv`` and ``attention_decode.py`` (same folder).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from functools import partial

import torch
from fast_path_checks import cuda_ms  # the benchmarks' one CUDA-event timer (same folder)

COLD_BYTES = 256 << 20
"""Bytes the copies' reads add up to in a cycle, five times the H200's 50 MB of L2."""


def copy_count(bytes_per_call: int, cold: bool = True) -> int:
    """Copies a graph cycles through: enough that ``COLD_BYTES`` are read in one cycle (1 unless ``cold``)."""
    if not cold:
        return 1
    return max(1, -(-COLD_BYTES // max(int(bytes_per_call), 1)))


def with_copies(tensors: Sequence[torch.Tensor], copies: int) -> list[tuple[torch.Tensor, ...]]:
    """``tensors`` themselves, then ``copies - 1`` sets of clones of them: one set a call of a cycle."""
    first = tuple(tensors)
    return [first] + [tuple(t.clone() for t in first) for _ in range(copies - 1)]


def copied_args(args: Sequence, positions: Sequence[int], copies: int) -> list[list]:
    """``copies`` argument lists: ``args`` as given, then lists whose tensors at ``positions`` are clones (the other
    arguments shared). ``calls_over`` makes a graph's calls of them."""
    sets = []
    for tensors in with_copies([args[i] for i in positions], copies):
        each = list(args)
        for position, tensor in zip(positions, tensors, strict=True):
            each[position] = tensor
        sets.append(each)
    return sets


def calls_over(fn: Callable, arg_sets: list[list], **kwargs) -> list[partial]:
    """``fn(*args, **kwargs)`` for each argument list of ``arg_sets``: the calls a ``cycle_graph`` takes in turn."""
    return [partial(fn, *args, **kwargs) for args in arg_sets]


def cycle_graph(fns: Callable | list[Callable], calls: int = 1, warmup: int = 1):
    """A CUDA graph of ``calls`` calls (at least one of each of ``fns``, rounded up to whole cycles) taking
    ``fns`` in turn, captured after ``warmup`` eager calls of the first and one of each other on a side stream
    (Triton compiles outside the capture). Returns the graph, its number of calls and its last call's output."""
    fns = fns if isinstance(fns, list) else [fns]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(max(warmup, 1)):
            fns[0]()
        for each in fns[1:]:  # the copies' calls once each (the same kernels, compiled by now)
            each()
    torch.cuda.current_stream().wait_stream(stream)
    calls = -(-max(calls, 1) // len(fns)) * len(fns)  # whole cycles: every copy read once between two reads of it
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in range(calls):
            out = fns[call % len(fns)]()
    return graph, calls, out


def graph_ms(fns: Callable | list[Callable], calls: int, repeats: int, warmup: int = 1) -> float:
    """Median device time of one call, from ``repeats`` replays (after one untimed) of a ``cycle_graph``."""
    graph, calls, _ = cycle_graph(fns, calls, warmup)
    graph.replay()
    return statistics.median(cuda_ms(graph.replay, repeats)) / calls


def mode_line(cold: bool, what: str) -> str:
    """A line saying how the graphs were timed: ``cold`` (calls cycle through copies of ``what``) or warm."""
    if cold:
        return (f"timed: cold (the graph's calls cycle through copies of the {what}, at least {COLD_BYTES >> 20} "
                f"MiB read a cycle: no call finds its bytes in the 50 MB L2)")  # fmt: skip
    return f"timed: warm (every call of a graph reads the same {what}: what fits in L2 is read from it; --cold: none)"
