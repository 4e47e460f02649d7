"""Independent work of a small step on a second CUDA stream: two chains of kernels that run at once.

At decode a layer's kernels are small. A one-token GEMV reads its weight at 2-3 TB/s on the H200, well short of
the memory's 4.8, and most other kernels are a few microseconds of latency each, so one stream leaves the GPU
mostly waiting. Where a layer has two chains that do not read each other's outputs (the MoE's shared expert and
its router plus routed experts), :func:`beside` runs one on the device's side stream while the other runs on the
current stream, and joins them before either result is read. CUDA graphs capture the two chains as parallel
branches, so a replay overlaps them too. SGLang and vLLM overlap DeepSeek's shared expert the same way.

Only the order of the kernels changes: each chain runs the same kernels on the same inputs as it does on one
stream, so the results are bit-identical. Kernels that share scratch memory across launches (the split kernels'
arrival counts, :mod:`dsinfer.ops.split_arrivals`) take a separate buffer on the side stream
(:func:`~dsinfer.ops.split_arrivals.arrival_lane`).

It applies on CUDA to steps of at most :data:`OVERLAP_MAX_TOKENS` tokens (``$DSINFER_OVERLAP_MAX_TOKENS``); larger
steps' kernels fill the GPU on their own. ``DSINFER_OVERLAP=0`` runs everything on one stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from dsinfer import envs
from dsinfer.ops.split_arrivals import arrival_lane

OVERLAP_MAX_TOKENS = envs.OVERLAP_MAX_TOKENS.default
SideResult = TypeVar("SideResult")
MainResult = TypeVar("MainResult")
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def overlap_enabled() -> bool:
    """``DSINFER_OVERLAP``: ``1`` (the default) or ``0``; anything else is an error."""
    return envs.OVERLAP.get()


def overlap_max_tokens() -> int:
    """``$DSINFER_OVERLAP_MAX_TOKENS`` (a non-negative integer), else :data:`OVERLAP_MAX_TOKENS`."""
    return envs.OVERLAP_MAX_TOKENS.get()


def overlaps(x: torch.Tensor) -> bool:
    """Whether a step whose activations are ``x`` ([tokens, ...]) runs independent chains on two streams."""
    return x.is_cuda and 0 < x.shape[0] <= overlap_max_tokens() and overlap_enabled()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's side stream, made on first use (a model's first step runs eagerly before any graph capture,
    so the stream exists before a capture needs it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = torch.device("cuda", index)
    stream = _SIDE_STREAMS.get(key)
    if stream is None:
        stream = _SIDE_STREAMS[key] = torch.cuda.Stream(key)
    return stream


def beside(
    side_work: Callable[[], SideResult], main_work: Callable[[], MainResult], x: torch.Tensor
) -> tuple[SideResult, MainResult]:
    """``(side_work(), main_work())``: on two streams when :func:`overlaps` says so for ``x``, else one after the
    other on the current stream.

    The side stream first waits for everything queued on the current stream, so ``side_work`` sees every input
    the step has made; the current stream then waits for the side stream, so whatever runs after this call sees
    both results. Memory stays safe without ``record_stream``: the inputs outlive the join (the caller holds
    them), and the side stream's next work always starts by waiting for the current stream, which is then past
    every read of the side result."""
    if not overlaps(x):
        return side_work(), main_work()
    main = torch.cuda.current_stream(x.device)
    side = side_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side), arrival_lane("side"):
        side_result = side_work()
    main_result = main_work()
    main.wait_stream(side)
    return side_result, main_result
