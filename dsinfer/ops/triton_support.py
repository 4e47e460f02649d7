"""Whether Triton kernels can run here: the one check every Triton backend registers with.

A backend serves CUDA devices when Triton is installed and a GPU is present; under Triton's interpreter
(``TRITON_INTERPRET=1``) the same kernels run on the CPU, which is how ``tests/ops`` checks them against the
references on machines without a GPU.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["interpreted", "triton_available"]


def interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``): no inline PTX, no real launches."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    """Whether Triton kernels can run: Triton installed, and a CUDA device or the interpreter."""
    return triton is not None and (torch.cuda.is_available() or interpreted())
