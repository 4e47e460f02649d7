"""A compressor's decode step (``compressor_decode`` and ``compressor_decode_store``): the Triton kernel (in Triton's
CPU interpreter; compiled on CUDA) against the torch reference, over several consecutive steps, and the reference
against the layer's prefill path.

Each case decodes ``steps`` tokens per sequence from random starting positions, so windows complete at different
steps, overlapping windows find or miss their predecessor (``window_from``), and state slots are shared by nobody.
After every step the state tensors must match, and so must the latents of tokens that completed their window
(the kernel leaves the others zero) and the cache entries outside the trash block. Bound: ``1e-2 |ref| + 1e-2``
for bf16 (one bf16 step where the softmax's ``exp`` or the order of the float32 sums differs in the last bit),
``1e-5 |ref| + 1e-5`` for float32.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.ops.compressor.reference import (
    CompressorDecodeInputs,
    CompressorStoreInputs,
    compressor_decode_reference,
    compressor_decode_store_reference,
)

CASES = [  # (batch, ratio, dim, overlap, slot bias, dtype, steps)
    (1, 4, 64, True, True, torch.bfloat16, 9),
    (5, 4, 32, True, True, torch.bfloat16, 6),
    (3, 16, 48, False, True, torch.bfloat16, 18),
    (4, 2, 32, False, False, torch.float32, 5),
    (2, 128, 64, False, True, torch.bfloat16, 3),
]
ROPE_HALF = 8
BLOCK_TOKENS = 256


def _bound(dtype: torch.dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 1e-5


def make_case(batch: int, ratio: int, dim: int, overlap: bool, bias: bool, dtype, seed: int, device: str):
    gen = torch.Generator().manual_seed(seed)
    width = 2 * dim if overlap else dim
    slots_total = batch + 2
    state = [torch.randn(slots_total, ratio, width, generator=gen).to(dtype) for _ in range(4 if overlap else 2)]
    slot_bias = torch.randn(ratio, width, generator=gen) if bias else None
    # Positions just before a window boundary or mid-window; block tables of distinct blocks per sequence.
    starts = torch.randint(0, 3 * ratio, (batch,), generator=gen) + ratio * (torch.arange(batch) % 3)
    slots = torch.randperm(slots_total, generator=gen)[:batch]
    window_from = torch.where(torch.arange(batch) % 2 == 0, 0, starts - ratio // 2).clamp(min=0)
    per_block = BLOCK_TOKENS // ratio
    max_blocks = 3
    tables = torch.arange(batch * max_blocks).view(batch, max_blocks)
    entries = torch.zeros(batch * max_blocks + 1, per_block, dim, dtype=dtype)
    norm_weight = torch.rand(dim, generator=gen) + 0.5
    moved = [t.to(device) if isinstance(t, torch.Tensor) else t for t in
             (starts, slots, window_from, tables, entries, norm_weight, slot_bias)]  # fmt: skip
    return [s.to(device) for s in state], moved, gen


def step_inputs(batch, width, dtype, gen, device):
    values = torch.randn(batch, width, generator=gen).to(dtype)
    gates = (torch.randn(batch, width, generator=gen) * 2).to(dtype)
    return values.to(device), gates.to(device)


def angles(positions: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    first = (positions - positions % ratio).float()
    freqs = first[:, None] * (1.0 / 10000 ** (torch.arange(ROPE_HALF).float() / ROPE_HALF))
    return freqs.cos(), freqs.sin()


def run_case(index: int, store: bool, device: str) -> list[str]:
    """One case, kernel on ``device`` against the reference on the CPU, step by step; the failures."""
    from dsinfer.ops.compressor.decode_triton import compressor_decode_store_triton, compressor_decode_triton

    batch, ratio, dim, overlap, bias, dtype, steps = CASES[index]
    width = 2 * dim if overlap else dim
    kernel_state, (starts, slots, window_from, tables, entries, norm, slot_bias), gen = make_case(
        batch, ratio, dim, overlap, bias, dtype, index, device
    )
    ref_state = [s.cpu().clone() for s in kernel_state]
    ref_entries, kernel_entries = entries.cpu().clone(), entries
    failures = []
    bound = _bound(dtype)

    def close(name, got, want, rows=None):
        got, want = got.cpu().float(), want.float()
        if rows is not None:
            got, want = got[rows], want[rows]
        if not bool(((got - want).abs() <= bound * want.abs() + bound).all()):
            failures.append(f"case {index} {name}: off by {float((got - want).abs().max()):.3g}")

    for step in range(steps):
        positions = starts + step
        values, gates = step_inputs(batch, width, dtype, gen, device)
        previous = (kernel_state[2], kernel_state[3]) if overlap else (None, None)
        ref_previous = (ref_state[2], ref_state[3]) if overlap else (None, None)
        common = (positions, slots, window_from)
        args = (values, gates, slot_bias, *common, kernel_state[0], kernel_state[1], *previous, norm, 1e-6, dtype)
        ref_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args[:6])
        ref_args += (ref_state[0], ref_state[1], *ref_previous, norm.cpu(), 1e-6, dtype)
        if store:
            cos, sin = angles(positions.cpu(), ratio)
            trash = entries.shape[0] - 1
            compressor_decode_store_triton(
                CompressorStoreInputs(*args, cos.to(device), sin.to(device), kernel_entries, tables, trash)
            )
            compressor_decode_store_reference(
                CompressorStoreInputs(*ref_args, cos, sin, ref_entries, tables.cpu(), trash)
            )
            close(f"step {step} entries", kernel_entries[:-1], ref_entries[:-1])
        else:
            latents, entry, complete = compressor_decode_triton(CompressorDecodeInputs(*args))
            ref_latents, ref_entry, ref_complete = compressor_decode_reference(CompressorDecodeInputs(*ref_args))
            if not (torch.equal(entry.cpu(), ref_entry) and torch.equal(complete.cpu(), ref_complete)):
                failures.append(f"case {index} step {step}: entry ids or completion differ")
            close(f"step {step} latents", latents, ref_latents, ref_complete)
            if bool((latents.cpu()[~ref_complete] != 0).any()):
                failures.append(f"case {index} step {step}: rows of incomplete windows are not zero")
        names = ("pending values", "pending gates", "previous values", "previous gates")[: len(ref_state)]
        for name, got, want in zip(names, kernel_state, ref_state, strict=True):
            close(f"step {step} {name}", got, want)
    return failures


def check(device: str) -> list[str]:
    failures = []
    for index in range(len(CASES)):
        for store in (False, True):
            failures += run_case(index, store, device)
    return failures


def run_interpreted_cases() -> list[str]:
    from test_sparse_attention import _interpret_bf16_as_hardware

    _interpret_bf16_as_hardware()  # the interpreter's float32 -> bf16 cast truncates: round to nearest even
    return check("cpu")


def test_triton_kernel_matches_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_compressor_decode")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need CUDA")
def test_triton_kernel_matches_reference_on_cuda():
    assert check("cuda") == []
