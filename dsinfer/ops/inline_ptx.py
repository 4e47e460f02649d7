"""Whether a Triton kernel may carry inline PTX (``tl.inline_asm_elementwise``) on a device."""

from __future__ import annotations

import os

import torch


def inline_ptx_available(device: torch.device) -> bool:
    """Compiled for an NVIDIA GPU: not the CPU, not ROCm, not Triton's interpreter (which runs no inline asm)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return device.type == "cuda" and torch.version.hip is None and not interpreted
