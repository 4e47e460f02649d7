"""Host memory the GPU reads in place: ``cudaHostRegister`` of a range, and a CUDA tensor aliasing it."""

from __future__ import annotations

import math
import mmap
import weakref

import torch

__all__ = ["HostRegistration", "host_tensor", "is_page_locked", "registered_empty"]

_MAPPED: dict[int, int] = {}  # live ranges of mapped_pages: start address -> bytes


class _CudaArrayInterface:
    """A byte range of (registered) host memory described by ``__cuda_array_interface__``."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def host_tensor(address: int, nbytes: int, device: torch.device | str) -> torch.Tensor:
    """A CUDA uint8 tensor aliasing ``nbytes`` of registered host memory at ``address`` (UVA, no copy).

    Kernels that read it fetch the bytes over PCIe; it works because a registered host range has the
    same address on the GPU under unified virtual addressing.
    """
    device = torch.device(device)
    with torch.cuda.device(device):
        return torch.as_tensor(_CudaArrayInterface(address, nbytes), device=device)


class HostRegistration:
    """``cudaHostRegister`` of a host range (page-locks it and maps it for the GPU); undone by :meth:`close`."""

    PORTABLE, MAPPED = 0x01, 0x02

    def __init__(self, address: int, nbytes: int, device: torch.device | str):
        self.address, self.nbytes, self.device = address, nbytes, torch.device(device)
        cudart = torch.cuda.cudart()
        with torch.cuda.device(self.device):
            error = cudart.cudaHostRegister(address, nbytes, self.PORTABLE | self.MAPPED)
        code = int(getattr(error, "value", error))
        if code != 0:
            raise RuntimeError(
                f"cudaHostRegister of {nbytes:,} bytes at {address:#x} failed with CUDA error {code} ({error}); "
                "the host placement needs page-lockable memory (check `ulimit -l` and free RAM)"
            )
        self._registered = True

    def close(self) -> None:
        if self._registered:
            self._registered = False
            with torch.cuda.device(self.device):
                torch.cuda.cudart().cudaHostUnregister(self.address)


def registered_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """An uninitialised host tensor of exactly its bytes, page-locked and mapped for ``device`` when that is CUDA.

    ``torch.empty(pin_memory=True)`` draws from torch's caching host allocator, which rounds every block up to a
    power of two: a 1.2 GiB layer of offloaded experts takes 2 GiB, and V4-Flash's 84 GiB of them would take about
    130. This maps anonymous pages of the exact size (its own pages: no other allocation shares a registered page)
    and registers them; the registration ends when the last tensor on them is freed. On a CPU ``device`` it is a
    plain tensor.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return torch.empty(shape, dtype=dtype)
    return mapped_pages(shape, dtype, lambda address, nbytes: HostRegistration(address, nbytes, device))


def mapped_pages(shape: tuple[int, ...], dtype: torch.dtype, register) -> torch.Tensor:
    """A tensor on anonymous pages of its exact size; ``register(address, nbytes)`` returns what ``close()``s when
    the pages are no longer used, called while they are still mapped."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        pages.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(pages)  # the tensor's storage holds this view; its end ends the registration, then the pages
    flat = torch.frombuffer(view, dtype=torch.uint8)
    registration = register(flat.data_ptr(), nbytes)
    _MAPPED[flat.data_ptr()] = nbytes
    weakref.finalize(view, _release, registration, pages, flat.data_ptr())
    return flat.view(dtype).view(shape)


def _release(registration, pages: mmap.mmap, address: int) -> None:
    """Unregister while the pages are mapped; they are unmapped when ``pages`` goes with this call."""
    _MAPPED.pop(address, None)
    registration.close()
    del pages


def is_page_locked(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lies in page-locked host memory: torch's pinned allocations, or pages of
    :func:`registered_empty` (known here by their range, whatever torch reports for registered memory)."""
    address = tensor.data_ptr()
    if any(start <= address < start + nbytes for start, nbytes in _MAPPED.items()):
        return True
    return tensor.device.type == "cpu" and tensor.is_pinned()
