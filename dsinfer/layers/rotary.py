"""Partial, interleaved rotary position embedding (RoPE), with YaRN for the compressed layers.

DeepSeek-V4 rotates only the last ``rope_dim`` channels of each head, pairing channels (0, 1), (2, 3)...
Because K = V, the attention output's rope slice carries the keys' rotation; it is undone by rotating
the output back with the query's angle (``inverse=True``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsinfer.config import YarnScaling
from dsinfer.ops.fake_quant import ActivationQuantizer
from dsinfer.ops.norm_rope import rms_normalize_rope_reference, rope_reference
from dsinfer.ops.registry import OpTable
from dsinfer.ops.rope_angles import rope_angles_reference
from dsinfer.ops.rope_round import RopeRoundInputs, RowChain


def rope_inverse_frequencies(rope_dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """One inverse frequency per channel pair; YaRN blends interpolated and original frequencies."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    base_freq = theta**exponents
    inv_freq = 1.0 / base_freq
    if yarn is None:
        return inv_freq

    def correction_dim(rotations: float) -> float:
        return (rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp
    interpolated = 1.0 / (yarn.factor * base_freq)
    return interpolated * (1 - keep_original) + inv_freq * keep_original


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [*positions.shape, rope_dim // 2], in float32 (the ``rope_angles`` op's reference)."""
    return rope_angles_reference(positions, inv_freq)


def step_rope_angles(
    batch, inv_freq: torch.Tensor, ratio: int = 1, ops: OpTable | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of a batch's positions (``ratio`` 1), or of the first position of each token's ``ratio``-token
    window (a compressor's entry angles), computed once per forward (by the ``rope_angles`` op of ``ops``, else its
    reference) and shared by every layer that asks.

    The model's forward empties ``batch.rope_angle_memo`` when it starts; the key holds the positions tensor and
    ``inv_freq`` themselves, so their ids cannot be reused while the entry lives.
    """
    positions = batch.positions
    key = (id(positions), id(inv_freq), ratio)
    memo = batch.rope_angle_memo
    if key not in memo:
        angles = ops.rope_angles if ops is not None else rope_angles_reference
        memo[key] = (positions, inv_freq, angles(positions, inv_freq, ratio))
    return memo[key][2]


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool = False,
    ops: OpTable | None = None,
    in_place: bool = False,
) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` ([N, ..., dim]) by per-row angles (the ``rope`` op).

    ``cos``/``sin`` are [N, rope_dim // 2]; they broadcast over any axes between N and the channels. ``in_place``
    (for a fresh ``x`` the caller owns, outside autograd): ``x``'s rope channels are rewritten and ``x`` returned.
    """
    in_place = in_place and not (torch.is_grad_enabled() and x.requires_grad)
    return (ops.rope if ops is not None else rope_reference)(x, cos, sin, inverse, in_place)


def normalize_and_rope(
    x: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, ops: OpTable | None = None
) -> torch.Tensor:
    """Weightless RMSNorm of ``x``'s rows, then :func:`apply_rope` on the result (the per-head query chain), as
    one op (``rms_normalize_rope``): a new tensor."""
    return (ops.rms_normalize_rope if ops is not None else rms_normalize_rope_reference)(x, eps, cos, sin)


@dataclass(frozen=True)
class RoundingPoint:
    """Where a row is rounded as trained: ``quantizer``'s method ``point`` (``window_kv``, ``index_keys``, ...),
    called with ``layer`` and ``ids``; no quantizer: no rounding."""

    quantizer: ActivationQuantizer | None
    point: str
    layer: object = None
    ids: torch.Tensor | None = None


def rope_and_round(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ops: OpTable | None,
    norm: torch.nn.Module | None = None,
    rounding: RoundingPoint | None = None,
    defer: bool = False,
) -> torch.Tensor | RowChain:
    """``norm(x)`` (an ``RMSNorm``; None: ``x``) through :func:`apply_rope`, then the rounding at ``rounding``'s
    point (None: no rounding): a new tensor.

    With an op table the chain is one op (``rope_and_round``) wherever the quantizer rounds the point as its
    class's base does; otherwise (the reference path, a quantizer that overrides the point) the steps run one
    after the other, each as before. ``defer`` (rows whose only use is a cache write): where the chain would be
    that one op, its arguments come back as a :class:`RowChain` instead, for the write to run with its store."""
    quantizer = rounding.quantizer if rounding is not None else None
    fused = (None, 0) if quantizer is None else quantizer.fusable_rounding(rounding.point)
    if ops is not None and fused is not None:
        weight, eps = (norm.weight, norm.eps) if norm is not None else (None, 0.0)
        if defer:
            return RowChain(ops, RopeRoundInputs(x, cos, sin, weight, eps, *fused))
        return ops.rope_and_round(RopeRoundInputs(x, cos, sin, weight, eps, *fused))
    y = apply_rope(norm(x) if norm is not None else x, cos, sin, ops=ops)
    return getattr(quantizer, rounding.point)(y, rounding.layer, rounding.ids) if quantizer is not None else y
