"""Whether Triton kernels can run here: the one check every Triton backend registers with, and the one import of
``triton`` and ``triton.language`` (as ``tl``) the Triton modules take theirs from: None on an install without
Triton, so a module's kernels stay behind ``if triton is not None`` and its backend is never chosen.

A backend serves CUDA devices when Triton is installed and a GPU is present; under Triton's interpreter
(``TRITON_INTERPRET=1``) the same kernels run on the CPU, which is how ``tests/ops`` checks them against the
references on machines without a GPU.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["interpreted", "tl", "triton", "triton_available"]


def interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``): no inline PTX, no real launches."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    """Whether Triton kernels can run: Triton installed, and a CUDA device or the interpreter."""
    return triton is not None and (torch.cuda.is_available() or interpreted())
