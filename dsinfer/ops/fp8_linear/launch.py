"""What the ``fp8_linear`` kernels share at launch: the split-K arrival counts, the number of splits, and how the
scales and e4m3 codes are read on a device."""

from __future__ import annotations

import torch

# Per device: one int32 count per output tile of a split launch, zero between launches (the last split of a tile
# sets it back). Launches on one stream run one after another, so they share it.
_ARRIVALS: dict[torch.device, torch.Tensor] = {}
_MAX_SPLIT_TILES = 1 << 14


def arrival_counts(device: torch.device, tiles: int) -> torch.Tensor | None:
    """The device's tile counts, made (zeroed) on first use; None where they cannot be (too many tiles, or first
    needed while a CUDA graph is being captured, where a zeroing would only be recorded): the launch then runs
    unsplit."""
    counts = _ARRIVALS.get(device)
    if counts is None:
        if tiles > _MAX_SPLIT_TILES or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return None
        counts = _ARRIVALS[device] = torch.zeros(_MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return counts if tiles <= counts.numel() else None


def choose_splits(tiles: int, inputs: int, block_k: int, device: torch.device, programs_per_sm: int = 4) -> int:
    """Splits of the input columns so that the launch has about ``programs_per_sm`` programs an SM (a tile's rows
    alone give a small weight too few programs to keep enough bytes in flight), each split at least two steps
    long."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    wanted = -(-programs_per_sm * sms // tiles)
    return max(1, min(wanted, inputs // (2 * block_k)))


def scale_operand(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The scales as the kernels take them: ue8m0 as their exponent bytes (True), else float32 (False)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8), True
    return scale, False


def hardware_fp8(device: torch.device) -> bool:
    """Whether Triton casts e4m3 bytes on this device (sm_89+, and the interpreter on the CPU)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
