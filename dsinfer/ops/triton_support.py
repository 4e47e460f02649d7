"""Whether Triton kernels can run here: the one check every Triton backend registers with, and the one import of
``triton`` and ``triton.language`` (as ``tl``) the Triton modules take theirs from: None on an install without
Triton, so a module's kernels stay behind ``if triton is not None`` and its backend is never chosen.

A backend serves CUDA devices when Triton is installed and a GPU is present; under Triton's interpreter
(``TRITON_INTERPRET=1``) the same kernels run on the CPU, which is how ``tests/ops`` checks them against the
references on machines without a GPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["interpreted", "launch_or_reference", "tl", "triton", "triton_available"]

logger = logging.getLogger(__name__)
Result = TypeVar("Result")


def interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``): no inline PTX, no real launches."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    """Whether Triton kernels can run: Triton installed, and a CUDA device or the interpreter."""
    return triton is not None and (torch.cuda.is_available() or interpreted())


def launch_or_reference(
    op: str,
    setting: tuple,
    launch: Callable[[], Result],
    reference: Callable[[], Result],
    failed: set[tuple],
    compiled: set[tuple],
) -> Result:
    """``launch()``, or ``reference()`` where this ``setting`` (what the kernel build fixes) failed to compile.

    A kernel that raises on its setting's first launch (this Triton version, the device's resources) is warned
    about once and the reference serves that setting from then on (``failed``); once a setting has run
    (``compiled``), a later error is a real one and propagates, as it does inside a CUDA graph capture, which
    must not record a half-run kernel."""
    if setting in failed:
        return reference()
    if setting in compiled:
        return launch()
    try:
        out = launch()
    except Exception as error:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise
        logger.warning("%s: Triton kernel failed (%s); using the torch reference", op, error)
        failed.add(setting)
        return reference()
    compiled.add(setting)
    return out
