"""Small host values to the device and results back, without making either side wait more than once.

A sampler step sends a few per-row parameters to the device (ids, penalties, noise keys) and reads the chosen
tokens back. ``torch.tensor(values, device="cuda")`` copies from pageable memory and waits for the stream, so
each one would stall the host behind the model's forward; these copy through pinned memory without blocking,
and :func:`read_back` waits for the device once for however many results it returns.

:func:`start_read_back` splits that in two: the copies are queued now and :meth:`HostCopies.wait` waits for
them later, so the thread that queued them is free meanwhile (the device worker launches the next step while
the engine thread waits for this one's tokens).
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


class HostCopies:
    """CPU copies of device tensors, queued on the current stream; :meth:`wait` returns them once they landed."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        cuda = next((t.device for t in tensors if t.is_cuda), None)
        if cuda is None:
            self._copies, self._done = [tensor.cpu() for tensor in tensors], None
            return
        self._copies = [tensor.to("cpu", non_blocking=True) for tensor in tensors]  # into pinned memory
        self._done = torch.cuda.Event()
        self._done.record(torch.cuda.current_stream(cuda))

    def wait(self) -> list[torch.Tensor]:
        """The copies, after waiting (without holding the Python lock) for the device to write them."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._copies


def start_read_back(*tensors: torch.Tensor) -> HostCopies:
    """Queue CPU copies of ``tensors``; one wait for the device later, however many there are."""
    return HostCopies(tensors)


def read_back(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU copies of ``tensors``: one wait for the device however many there are."""
    return start_read_back(*tensors).wait()
