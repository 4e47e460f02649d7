"""Host memory the GPU reads in place: ``cudaHostRegister`` of a range, and a CUDA tensor aliasing it."""

from __future__ import annotations

import torch

__all__ = ["HostRegistration", "host_tensor"]


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
