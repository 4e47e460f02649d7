"""Host memory the GPU reads in place, of its exact size: pages are registered once and released only after the last
tensor on them is freed, while they are still mapped (an unregister after the unmap would leave the driver a stale
range)."""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch

from dsinfer.engram.fetch.host_memory import is_page_locked, mapped_pages, registered_empty


class RecordingRegistration:
    """Stands in for ``cudaHostRegister``: records the range, and reads it at ``close`` (a crash if unmapped)."""

    log: list = []

    def __init__(self, address: int, nbytes: int):
        self.address, self.nbytes = address, nbytes
        self.log.append(("register", nbytes))

    def close(self) -> None:
        self.log.append(("close", ctypes.string_at(self.address, self.nbytes)))


@pytest.fixture(autouse=True)
def fresh_log():
    RecordingRegistration.log = []


def test_pages_hold_exactly_the_tensors_bytes_and_stay_registered_while_a_view_lives():
    tensor = mapped_pages((3, 5), torch.int32, RecordingRegistration)
    assert tensor.shape == (3, 5) and tensor.dtype == torch.int32
    assert RecordingRegistration.log == [("register", 60)]
    tensor.fill_(7)
    view = tensor[1:]
    assert is_page_locked(tensor) and is_page_locked(view)  # known by their range, as registered pages
    assert not is_page_locked(torch.empty(3))
    del tensor
    gc.collect()
    assert RecordingRegistration.log == [("register", 60)]  # the view still reads the pages
    assert view.sum().item() == 70
    del view
    gc.collect()
    assert RecordingRegistration.log == [("register", 60), ("close", (7).to_bytes(4, "little") * 15)]
    assert not is_page_locked(torch.empty(3, dtype=torch.int32))  # the range is forgotten with the pages


def test_an_empty_shape_registers_nothing():
    tensor = mapped_pages((0, 4), torch.uint8, RecordingRegistration)
    assert tensor.shape == (0, 4)
    assert RecordingRegistration.log == []


def test_on_a_cpu_device_it_is_a_plain_tensor():
    tensor = registered_empty((2, 3), torch.bfloat16, "cpu")
    assert tensor.shape == (2, 3) and tensor.dtype == torch.bfloat16 and not tensor.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_pages_are_pinned_and_the_gpu_reads_them():
    from dsinfer.engram.fetch.host_memory import host_tensor

    tensor = registered_empty((1000, 3), torch.uint8, "cuda")
    tensor.copy_(torch.arange(3000, dtype=torch.int64).remainder(251).to(torch.uint8).view(1000, 3))
    assert tensor.is_pinned()
    alias = host_tensor(tensor.data_ptr(), tensor.numel(), "cuda").view(1000, 3)
    assert torch.equal(alias.cpu(), tensor)
