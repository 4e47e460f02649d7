"""The one import of Gluon, Triton's layout-explicit dialect, and of its Hopper language, which the Gluon kernels
take theirs from: None on an install without them, so a module's Gluon kernels stay behind ``if gluon is not
None``. Also the names that moved between Triton versions, and whether the Hopper kernels run on a device.

Triton's interpreter does not run Gluon: those kernels' tests run on an sm_90 GPU, and their sm_90 builds are
checked on the CPU.
"""

from __future__ import annotations

import functools

import torch

from dsinfer.ops.triton_support import interpreted

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
except ImportError:  # pragma: no cover - depends on the install
    gluon = gl = async_copy = fence_async_shared = warpgroup_mma = warpgroup_mma_wait = None

if gluon is not None:
    # Triton 3.6's names, then 3.8's
    block_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    copy_to_shared = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
else:  # pragma: no cover - depends on the install
    block_barrier = copy_to_shared = None

__all__ = [
    "async_copy",
    "block_barrier",
    "copy_to_shared",
    "fence_async_shared",
    "gl",
    "gluon",
    "hopper_gluon_runs",
    "warpgroup_mma",
    "warpgroup_mma_wait",
]


@functools.lru_cache(maxsize=8)
def _is_hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def hopper_gluon_runs(device: torch.device) -> bool:
    """Whether the Gluon Hopper kernels run on ``device``: Gluon installed, a CUDA sm_90 device, no interpreter."""
    return gluon is not None and not interpreted() and device.type == "cuda" and _is_hopper(device)
