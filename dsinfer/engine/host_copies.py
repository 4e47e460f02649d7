"""Small host values to the device and results back, without making either side wait more than once.

A sampler step sends a few per-row parameters to the device (ids, penalties, noise keys) and reads the chosen
tokens back. ``torch.tensor(values, device="cuda")`` copies from pageable memory and waits for the stream, so
each one would stall the host behind the model's forward; these copy through pinned memory without blocking,
and :func:`read_back` waits for the device once for however many results it returns.
"""

from __future__ import annotations

import torch

from dsinfer.kv.batch import host_to_device


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (a list, or a list of equal-length rows) as a ``dtype`` tensor on ``device``."""
    return host_to_device(values, dtype, device)


def device_index(values: list[int], device: torch.device | str) -> torch.Tensor:
    """An int64 index tensor of ``values`` on ``device``."""
    return to_device(values, torch.int64, device)


def read_back(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU copies of ``tensors``: one wait for the device however many there are."""
    if not any(tensor.is_cuda for tensor in tensors):
        return [tensor.cpu() for tensor in tensors]
    copies = [tensor.to("cpu", non_blocking=True) for tensor in tensors]
    torch.cuda.current_stream(next(t.device for t in tensors if t.is_cuda)).synchronize()
    return copies
