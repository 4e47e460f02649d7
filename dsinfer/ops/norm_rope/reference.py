"""The truth for RMSNorm (with and without a weight) and the partial, interleaved RoPE DeepSeek uses
(``dsinfer.layers.norm`` / ``rotary`` call these; a faster backend registers beside them)."""

from __future__ import annotations

import torch

from dsinfer.ops.registry import REFERENCE, register


@register("rms_norm", REFERENCE)
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last axis, computed in float32 and cast back to ``x``'s dtype once."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x32).to(x.dtype)


@register("rms_normalize", REFERENCE)
def rms_normalize_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm over the last axis (the per-head query norm, mHC's input norm): the scale is computed in
    float32, rounded to ``x``'s dtype and multiplied in it."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


@register("rope", REFERENCE)
def rope_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False, in_place: bool = False
) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x`` ([N, ..., dim]) by per-row angles.

    Channel pairs (0, 1), (2, 3)... of the rope slice rotate together; ``cos`` / ``sin`` are [N, rope_dim // 2] and
    broadcast over any axes between N and the channels; ``inverse`` rotates back (the output's rope slice).
    ``in_place``: the rope slice of ``x`` itself is overwritten and ``x`` returned (the caller owns ``x``; the
    nope channels are not touched, so a prefill's queries are not copied once more).
    """
    rope_dim = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        sin = -sin
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    if in_place:
        x[..., -rope_dim:] = rotated.to(x.dtype)
        return x
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


@register("rms_normalize_rope", REFERENCE)
def rms_normalize_rope_reference(x: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The per-head query chain: :func:`rms_normalize_reference`, then :func:`rope_reference` on its (fresh)
    result, in place. A new tensor shaped and typed like ``x``."""
    normed = rms_normalize_reference(x, eps)
    return rope_reference(normed, cos, sin, in_place=not (torch.is_grad_enabled() and normed.requires_grad))
