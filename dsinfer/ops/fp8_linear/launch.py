"""What the ``fp8_linear`` kernels share at launch: the number of splits, the split layout (its arrival counts
come from :mod:`dsinfer.ops.split_arrivals`), and how the scales and e4m3 codes are read on a device."""

from __future__ import annotations

import torch

from dsinfer.ops.split_arrivals import arrival_counts


def choose_splits(tiles: int, inputs: int, block_k: int, device: torch.device, programs_per_sm: int = 4) -> int:
    """Splits of the input columns so that the launch has about ``programs_per_sm`` programs an SM (a tile's rows
    alone give a small weight too few programs to keep enough bytes in flight), each split at least two steps
    long."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
    wanted = -(-programs_per_sm * sms // tiles)
    return max(1, min(wanted, inputs // (2 * block_k)))


def plan_splits(
    device: torch.device, tiles: int, inputs: int, block_k: int, splits: int, partial_shape: tuple[int, ...]
) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """A split launch's layout: ``splits`` (asked for; the launch may take fewer: whole steps per split, no
    counts to be had), the input columns per split, the tile counts (an empty tensor when unsplit) and the float32
    partial sums ``[splits, *partial_shape]`` (empty when unsplit)."""
    steps = -(-inputs // block_k)
    k_per_split = -(-steps // splits) * block_k
    splits = -(-inputs // k_per_split)
    arrived = arrival_counts(device, tiles) if splits > 1 else None
    if arrived is None:
        splits, k_per_split = 1, inputs
        arrived = torch.empty(0, dtype=torch.int32, device=device)
    partial = torch.empty(splits if splits > 1 else 0, *partial_shape, dtype=torch.float32, device=device)
    return splits, k_per_split, arrived, partial


def kernel_operands(
    x: torch.Tensor, rows: int, inputs: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``x`` as rows with unit column stride ``[tokens, width]``, the output ``[tokens, rows]`` in ``dtype``, and
    whether a kernel must run (False: the output is already the answer, empty or the zeros of no inputs)."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[-1] and flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(flat.shape[0], rows, dtype=dtype, device=x.device)
    if out.numel() and inputs == 0:
        out.zero_()
    return flat, out, out.numel() > 0 and inputs > 0


def scale_operand(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The scales as the kernels take them: ue8m0 as their exponent bytes (True), else float32 (False)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8), True
    return scale, False


def hardware_fp8(device: torch.device) -> bool:
    """Whether Triton casts e4m3 bytes on this device (sm_89+, and the interpreter on the CPU)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
