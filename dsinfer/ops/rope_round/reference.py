"""The truth for ``rope_and_round`` (the norm, rotary and fake-quantization references, one after the other) and
``rope_round_store`` (that chain, then the cache write of its rows: ``cache_store``).

V4.1 rounds four activations right after their RoPE (see :mod:`dsinfer.ops.fake_quant`): the window K=V after
``kv_norm``, the compressed entries, the index keys after ``k_norm`` and the index queries. Unfused, each chain
is two or three kernels that read and write the same rows; the op states the chain once so a backend can run it
as one pass. ``rounding`` None leaves the rounding out (V4's ``kv_norm`` and RoPE, or V4.1 with its rounding
off).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.cache_codec.reference import CacheStoreInputs, cache_store_reference
from dsinfer.ops.fake_quant.reference import fake_quant_fp4, fake_quant_fp8
from dsinfer.ops.norm_rope.reference import rms_norm_reference, rope_reference
from dsinfer.ops.registry import REFERENCE, register

ROUNDINGS = ("fp8", "fp4_e4m3", "fp4_ue8m0")  # e4m3 codes with ue8m0 scales; e2m1 codes with e4m3 / ue8m0 scales


def round_rows(x: torch.Tensor, rounding: str | None, block: int) -> torch.Tensor:
    """``x`` through ``rounding`` in blocks of ``block`` channels (None: ``x`` itself)."""
    if rounding is None:
        return x
    if rounding == "fp8":
        return fake_quant_fp8(x, block)
    if rounding in ("fp4_e4m3", "fp4_ue8m0"):
        return fake_quant_fp4(x, block, e4m3_scales=rounding == "fp4_e4m3")
    raise ValueError(f"rope_and_round: unknown rounding {rounding!r} (expected one of {ROUNDINGS} or None)")


@register("rope_and_round", REFERENCE)
def rope_and_round_reference(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 0.0,
    rounding: str | None = None,
    block: int = 0,
) -> torch.Tensor:
    """``round(rope(rms_norm(x, weight, eps), cos, sin))`` over the last axis of ``x`` ([N, ..., dim]).

    ``weight`` None: no norm. ``cos`` / ``sin`` [N, rope_dim // 2] rotate the trailing rope channels (see
    :func:`rope_reference`); ``rounding`` (one of :data:`ROUNDINGS`, or None) rounds the rotated rows in blocks of
    ``block`` channels. A new tensor shaped and typed like ``x``."""
    y = x if weight is None else rms_norm_reference(x, weight, eps)
    y = rope_reference(y, cos, sin, in_place=y is not x and not (torch.is_grad_enabled() and y.requires_grad))
    return round_rows(y, rounding, block)


@dataclass(frozen=True)
class RopeRoundStoreInputs:
    """A decode step's rows, ``rope_and_round(x, cos, sin, weight, eps, rounding, block)``, and the cache pool they
    are written to as ``cache_store`` writes them (``data`` .. ``scale``; the format's block is ``code_block``)."""

    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    weight: torch.Tensor | None
    eps: float
    rounding: str | None
    block: int
    data: torch.Tensor
    scales: torch.Tensor | None
    first: torch.Tensor
    second: torch.Tensor
    modulus: int | None
    element: str | None
    code_block: int
    scale: str | None

    @property
    def chain(self) -> tuple:
        """``rope_and_round``'s arguments."""
        return self.x, self.cos, self.sin, self.weight, self.eps, self.rounding, self.block

    def store_of(self, rows: torch.Tensor) -> CacheStoreInputs:
        """``cache_store``'s arguments for ``rows`` (the chain's rows, however computed)."""
        return CacheStoreInputs(rows, self.data, self.scales, self.first, self.second, self.modulus, self.element,
                                self.code_block, self.scale)  # fmt: skip


@register("rope_round_store", REFERENCE)
def rope_round_store_reference(inputs: RopeRoundStoreInputs) -> None:
    """``cache_store(rope_and_round(x, cos, sin, weight, eps, rounding, block), data, scales, first, second,
    modulus, element, code_block, scale)``: a decode step's rows computed and written to the cache in one op, so a
    backend can do both in one pass (the rows themselves are not kept)."""
    cache_store_reference(inputs.store_of(rope_and_round_reference(*inputs.chain)))
