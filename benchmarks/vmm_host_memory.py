"""Host memory allocated and mapped through the CUDA driver's virtual memory management (ctypes; benchmarks).

``cuMemCreate`` with a ``HOST_NUMA`` location gives page-locked host memory that the driver maps
into one virtual range for both the CPU and the GPU, in chunks of its allocation granularity
(2 MiB where huge pages back it). Memory registered with ``cudaHostRegister`` instead is mapped for
the GPU page by page; which of the two the GPU translates faster for scattered reads is what
``benchmarks/engram_translation_probe.py`` measures.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

__all__ = ["CudaDriverError", "VmmHostMemory", "cuda_driver"]

_PINNED = 1
_HANDLE_NONE = 0
_LOCATION_DEVICE, _LOCATION_HOST, _LOCATION_HOST_NUMA = 1, 2, 3
_PROT_READWRITE = 3
_GRANULARITY_MINIMUM, _GRANULARITY_RECOMMENDED = 0, 1


class CudaDriverError(RuntimeError):
    """A CUDA driver call returned an error; ``code`` is the ``CUresult``."""

    def __init__(self, call: str, code: int, name: str):
        super().__init__(f"{call} failed with CUDA driver error {code} ({name})")
        self.call, self.code = call, code


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _Driver:
    """The few ``libcuda`` entry points used here, each checked."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        u64, size_t, p = ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER
        self._sig("cuGetErrorName", [ctypes.c_int, p(ctypes.c_char_p)])
        self._sig("cuMemGetAllocationGranularity", [p(size_t), p(_AllocationProp), ctypes.c_int])
        self._sig("cuMemCreate", [p(u64), size_t, p(_AllocationProp), ctypes.c_ulonglong])
        self._sig("cuMemAddressReserve", [p(u64), size_t, size_t, u64, ctypes.c_ulonglong])
        self._sig("cuMemMap", [u64, size_t, size_t, u64, ctypes.c_ulonglong])
        self._sig("cuMemSetAccess", [u64, size_t, p(_AccessDesc), size_t])
        self._sig("cuMemUnmap", [u64, size_t])
        self._sig("cuMemAddressFree", [u64, size_t])
        self._sig("cuMemRelease", [u64])

    def _sig(self, name: str, argtypes: list) -> None:
        function = getattr(self.lib, name)
        function.argtypes, function.restype = argtypes, ctypes.c_int

    def __call__(self, name: str, *args) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorName(code, ctypes.byref(text))
            raise CudaDriverError(name, code, (text.value or b"?").decode())


@cache
def cuda_driver() -> _Driver:
    """The CUDA driver library (``libcuda.so.1``); raises ``OSError`` where there is none."""
    return _Driver(ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1"))


class VmmHostMemory:
    """``nbytes`` (rounded up to the granularity) of pinned host memory mapped for the CPU and one GPU.

    ``address`` is valid in this process on the CPU and, through unified addressing, on ``device``
    (wrap it with :func:`dsinfer.engram.fetch.host_tensor`). A CUDA context must be current on the
    calling thread (initialise torch on the device first). ``numa_node`` picks the host NUMA node;
    ``location="host"`` asks for no particular node.
    """

    def __init__(
        self,
        nbytes: int,
        device: int,
        *,
        numa_node: int = 0,
        location: str = "host_numa",
        granularity: str = "recommended",
    ):
        if location not in ("host_numa", "host"):
            raise ValueError(f"location must be 'host_numa' or 'host', got {location!r}")
        driver = cuda_driver()
        self.device = device
        prop = self._prop(location, numa_node)
        self.granularity = self.query_granularity(location, numa_node, granularity)
        self.nbytes = -(-nbytes // self.granularity) * self.granularity
        self._handle = ctypes.c_uint64(0)
        self._address = ctypes.c_uint64(0)
        self._mapped = False
        try:
            driver("cuMemCreate", ctypes.byref(self._handle), self.nbytes, ctypes.byref(prop), 0)
            driver("cuMemAddressReserve", ctypes.byref(self._address), self.nbytes, self.granularity, 0, 0)
            driver("cuMemMap", self._address, self.nbytes, 0, self._handle, 0)
            self._mapped = True
            access = (_AccessDesc * 2)()
            access[0].location = _Location(_LOCATION_DEVICE, device)
            access[0].flags = _PROT_READWRITE
            access[1].location = _Location(_LOCATION_HOST_NUMA, numa_node)
            access[1].flags = _PROT_READWRITE
            driver("cuMemSetAccess", self._address, self.nbytes, access, 2)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _prop(location: str, numa_node: int) -> _AllocationProp:
        prop = _AllocationProp()
        prop.type = _PINNED
        prop.requestedHandleTypes = _HANDLE_NONE
        prop.location = _Location(_LOCATION_HOST_NUMA if location == "host_numa" else _LOCATION_HOST, numa_node)
        return prop

    @classmethod
    def query_granularity(cls, location: str = "host_numa", numa_node: int = 0, which: str = "recommended") -> int:
        """The driver's allocation granularity in bytes for host memory of ``location``."""
        prop = cls._prop(location, numa_node)
        value = ctypes.c_size_t(0)
        flag = _GRANULARITY_RECOMMENDED if which == "recommended" else _GRANULARITY_MINIMUM
        cuda_driver()("cuMemGetAllocationGranularity", ctypes.byref(value), ctypes.byref(prop), flag)
        return value.value

    @property
    def address(self) -> int:
        """Start of the mapping (CPU and GPU virtual address)."""
        return self._address.value

    def close(self) -> None:
        """Unmap, free the range and release this process's reference (idempotent)."""
        driver = cuda_driver()
        if self._mapped:
            self._mapped = False
            driver("cuMemUnmap", self._address, self.nbytes)
        if self._address.value:
            driver("cuMemAddressFree", self._address, self.nbytes)
            self._address = ctypes.c_uint64(0)
        if self._handle.value:
            driver("cuMemRelease", self._handle)
            self._handle = ctypes.c_uint64(0)

    def __enter__(self) -> VmmHostMemory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
