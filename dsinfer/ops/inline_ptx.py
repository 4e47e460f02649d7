"""Whether a Triton kernel may carry inline PTX (``tl.inline_asm_elementwise``) on a device."""

from __future__ import annotations

import torch

from dsinfer.ops.triton_support import interpreted


def inline_ptx_available(device: torch.device) -> bool:
    """Compiled for an NVIDIA GPU: not the CPU, not ROCm, not Triton's interpreter (which runs no inline asm)."""
    return device.type == "cuda" and torch.version.hip is None and not interpreted()
