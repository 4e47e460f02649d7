"""The routed experts of one MoE layer, stacked, in checkpoint precision: the layout every ``routed_moe`` backend reads.

Why stacked and packed: the released checkpoints store routed experts as FP4 (e2m1, two codes per byte) with
one power-of-two scale per 32 inputs; dequantised to bf16 they take 3.76x the bytes, which does not fit one
H200. A grouped kernel also wants one base pointer per tensor, so the experts of a layer are stacked along a
leading expert axis.

Layout (``E`` experts, hidden size ``H``, expert intermediate size ``I``; ``H`` and ``I`` multiples of 32 for FP4):

FP4 form (``is_fp4 = True``), exactly the checkpoint's bytes, row-major and contiguous:

* ``w13`` ``uint8 [E, 2*I, H/2]``: rows ``0 .. I-1`` are ``w1`` (the gate), rows ``I .. 2I-1`` are ``w3`` (the up
  projection), each row one output channel over the ``H`` inputs. Byte ``j`` of a row holds input ``2j`` in its
  low nibble and input ``2j+1`` in its high nibble; a nibble is an e2m1 code (bit 3 the sign, bits 0-2 index
  ``0, 0.5, 1, 1.5, 2, 3, 4, 6``). The checkpoint's ``int8`` bytes are reinterpreted (``.view(torch.uint8)``).
* ``w13_scale`` ``uint8 [E, 2*I, H/32]``: ue8m0 bytes, scale ``2**(byte - 127)`` for inputs ``32g .. 32g+31``
  of the same row (the checkpoint's ``float8_e8m0fnu`` viewed as ``uint8``).
* ``w2`` ``uint8 [E, H, I/2]`` and ``w2_scale`` ``uint8 [E, H, I/32]``: the down projection, same encoding,
  inputs along ``I``.

Dense form (``is_fp4 = False``; checkpoints stored in bf16/fp32, e.g. Hugging Face-format test checkpoints):
``w13`` float ``[E, 2*I, H]`` (same row order), ``w2`` float ``[E, H, I]``, both scales ``None``.

The math every backend computes for expert ``e`` on a token ``x`` (``dsinfer.layers.moe.Expert``):
``gate = (x @ w1.T).clamp(max=limit)``, ``up = (x @ w3.T).clamp(-limit, limit)``,
``y = (silu(gate) * up) @ w2.T``, mixed by the router's weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.ops.quant import FP4_GROUP, dequantize_fp4

__all__ = ["ExpertWeights", "dequantize_expert", "stack_experts"]

_DENSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's routed experts; see the module docstring for the exact layout of each tensor."""

    w13: torch.Tensor
    w13_scale: torch.Tensor | None
    w2: torch.Tensor
    w2_scale: torch.Tensor | None
    intermediate_size: int
    is_fp4: bool

    def __post_init__(self) -> None:
        self._validate()

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes the weights occupy on their device (what the loaded-bytes budget counts)."""
        tensors = (self.w13, self.w13_scale, self.w2, self.w2_scale)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def _validate(self) -> None:
        """Reject a layout the kernels would misread (they trust shapes and strides blindly)."""
        inter = self.intermediate_size
        if self.w13.dim() != 3 or self.w2.dim() != 3:
            raise ValueError(f"w13 and w2 must be 3-D [E, ...], got {tuple(self.w13.shape)} and {tuple(self.w2.shape)}")
        experts, hidden = self.w13.shape[0], self.w2.shape[1]
        if self.is_fp4:
            if self.w13_scale is None or self.w2_scale is None:
                raise ValueError("FP4 expert weights need w13_scale and w2_scale")
            if hidden % FP4_GROUP or inter % FP4_GROUP:
                raise ValueError(f"FP4 experts need hidden {hidden} and intermediate {inter} divisible by {FP4_GROUP}")
            expected = {
                "w13": (self.w13, (experts, 2 * inter, hidden // 2)),
                "w13_scale": (self.w13_scale, (experts, 2 * inter, hidden // FP4_GROUP)),
                "w2": (self.w2, (experts, hidden, inter // 2)),
                "w2_scale": (self.w2_scale, (experts, hidden, inter // FP4_GROUP)),
            }
            for name, (tensor, shape) in expected.items():
                if tensor.dtype != torch.uint8:
                    raise ValueError(f"FP4 {name} must be uint8 bytes, got {tensor.dtype}")
                if tuple(tensor.shape) != shape:
                    raise ValueError(f"FP4 {name} must have shape {shape}, got {tuple(tensor.shape)}")
        else:
            if self.w13_scale is not None or self.w2_scale is not None:
                raise ValueError("dense expert weights take no scales")
            for name, tensor in (("w13", self.w13), ("w2", self.w2)):
                if tensor.dtype not in _DENSE_DTYPES:
                    raise ValueError(f"dense {name} must be float32/bfloat16/float16, got {tensor.dtype}")
            if tuple(self.w13.shape) != (experts, 2 * inter, hidden) or tuple(self.w2.shape) != (
                experts,
                hidden,
                inter,
            ):
                raise ValueError(
                    f"dense w13 must be [E, 2*I, H] and w2 [E, H, I] with I={inter}, "
                    f"got {tuple(self.w13.shape)} and {tuple(self.w2.shape)}"
                )
        for name in ("w13", "w13_scale", "w2", "w2_scale"):
            tensor = getattr(self, name)
            if tensor is not None and not tensor.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
            if tensor is not None and tensor.device != self.w13.device:
                raise ValueError(f"{name} is on {tensor.device} but w13 is on {self.w13.device}")


def stack_experts(
    w1: list[torch.Tensor],
    w3: list[torch.Tensor],
    w2: list[torch.Tensor],
    w1_scale: list[torch.Tensor] | None = None,
    w3_scale: list[torch.Tensor] | None = None,
    w2_scale: list[torch.Tensor] | None = None,
) -> ExpertWeights:
    """Stack per-expert checkpoint tensors (``w1``/``w3`` ``[I, H(/2)]``, ``w2`` ``[H, I(/2)]``) into the layout.

    With scales the tensors are the checkpoint's FP4 bytes (``int8``/``uint8``, scales ``float8_e8m0fnu`` or
    ``uint8``) and are kept as bytes; without, they are dense floats kept in their dtype.
    """
    fp4 = w1_scale is not None
    if fp4 != (w3_scale is not None) or fp4 != (w2_scale is not None):
        raise ValueError("give scales for all of w1, w3, w2 (FP4) or for none (dense)")

    def as_bytes(tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([t.contiguous().view(torch.uint8) for t in tensors])

    inter = w1[0].shape[0]
    if fp4:
        w13 = torch.cat([as_bytes(w1), as_bytes(w3)], dim=1)
        w13_scale = torch.cat([as_bytes(w1_scale), as_bytes(w3_scale)], dim=1)
        return ExpertWeights(w13, w13_scale, as_bytes(w2), as_bytes(w2_scale), inter, True)
    w13 = torch.cat([torch.stack(w1), torch.stack(w3)], dim=1).contiguous()
    return ExpertWeights(w13, None, torch.stack(w2).contiguous(), None, inter, False)


def dequantize_expert(weights: ExpertWeights, expert: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``expert``'s ``(w13 [2I, H], w2 [H, I])`` in ``dtype``; exact for FP4 codes times power-of-two scales."""
    if not weights.is_fp4:
        return weights.w13[expert].to(dtype), weights.w2[expert].to(dtype)
    e8m0 = torch.float8_e8m0fnu
    w13 = dequantize_fp4(weights.w13[expert], weights.w13_scale[expert].view(e8m0), dtype=dtype)
    w2 = dequantize_fp4(weights.w2[expert], weights.w2_scale[expert].view(e8m0), dtype=dtype)
    return w13, w2
