"""The truth for ``rope_and_round`` (the norm, rotary and fake-quantization references, one after the other) and
``rope_round_store`` (that chain, then the cache write of its rows: ``cache_store``).

V4.1 rounds four activations right after their RoPE (see :mod:`dsinfer.ops.fake_quant`): the window K=V after
``kv_norm``, the compressed entries, the index keys after ``k_norm`` and the index queries. Unfused, each chain
is two or three kernels that read and write the same rows; the op states the chain once so a backend can run it
as one pass. ``rounding`` None leaves the rounding out (V4's ``kv_norm`` and RoPE, or V4.1 with its rounding
off).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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


@dataclass(frozen=True)
class RopeRoundInputs:
    """A row chain: the rows ``x`` [N, ..., dim] through the weighted RMSNorm (``weight`` [dim] and ``eps``; None:
    no norm), RoPE by ``cos`` / ``sin`` [N, rope_dim // 2] on the trailing rope channels (see
    :func:`rope_reference`), then ``rounding`` (one of :data:`ROUNDINGS`, or None) in blocks of ``block``
    channels."""

    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    weight: torch.Tensor | None = None
    eps: float = 0.0
    rounding: str | None = None
    block: int = 0


@register("rope_and_round", REFERENCE)
def rope_and_round_reference(inputs: RopeRoundInputs) -> torch.Tensor:
    """``round(rope(rms_norm(x, weight, eps), cos, sin))`` over the last axis of ``x`` (see
    :class:`RopeRoundInputs`): a new tensor shaped and typed like ``x``."""
    x, weight = inputs.x, inputs.weight
    y = x if weight is None else rms_norm_reference(x, weight, inputs.eps)
    in_place = y is not x and not (torch.is_grad_enabled() and y.requires_grad)
    y = rope_reference(y, inputs.cos, inputs.sin, in_place=in_place)
    return round_rows(y, inputs.rounding, inputs.block)


@dataclass(frozen=True)
class RopeRoundStoreInputs:
    """A decode step's row chain and the cache write of its rows: ``store`` is ``cache_store``'s inputs with the
    chain's input rows ``chain.x`` standing for the rows the chain gives (their shape and dtype); the op writes
    the chain's rows in their place (:meth:`store_of`). :meth:`of` makes one from a chain and a pool."""

    chain: RopeRoundInputs
    store: CacheStoreInputs

    @classmethod
    def of(cls, chain: RopeRoundInputs, *pool) -> RopeRoundStoreInputs:
        """The chain's rows to be written as ``cache_store(CacheStoreInputs(rows, *pool))`` writes them."""
        return cls(chain, CacheStoreInputs(chain.x, *pool))

    def store_of(self, rows: torch.Tensor) -> CacheStoreInputs:
        """``cache_store``'s inputs for ``rows`` (the chain's rows, however computed)."""
        return replace(self.store, values=rows)


@register("rope_round_store", REFERENCE)
def rope_round_store_reference(inputs: RopeRoundStoreInputs) -> None:
    """``cache_store`` of ``rope_and_round``'s rows: a decode step's rows computed and written to the cache in one
    op, so a backend can do both in one pass (the rows themselves are not kept)."""
    cache_store_reference(inputs.store_of(rope_and_round_reference(inputs.chain)))
