"""Straight-through rounding for the last training phase: the forward sees what the shipped model computes.

Weights stored as FP8 (32x32 blocks, ue8m0 scales) or packed FP4 (ue8m0 scale per 32) in the release files
are rounded to those formats in the forward; the activations the V4.1 reference rounds (window KV, compressed
KV, indexer q/k) are rounded by the model's own quantizer. Gradients pass through every rounding unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from dsinfer.ops.fake_quant import ActivationQuantizer
from dsinfer.ops.quant import dequantize_fp4, dequantize_fp8_blockwise, quantize_fp4, quantize_fp8_blockwise

__all__ = ["StraightThroughQuantizer", "round_weights_straight_through", "remove_weight_rounding"]


def _straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    return x + (rounded.to(x.dtype) - x).detach()


class StraightThroughQuantizer(ActivationQuantizer):
    """The model's activation rounding, with the identity as its gradient."""

    def __init__(self) -> None:
        super().__init__(enabled=True)

    def window_kv(self, x, layer, positions):
        return _straight_through(x, super().window_kv(x.detach(), layer, positions))

    def compressed_kv(self, x, layer, entry_ids):
        return _straight_through(x, super().compressed_kv(x.detach(), layer, entry_ids))

    def index_keys(self, x, layer, entry_ids):
        return _straight_through(x, super().index_keys(x.detach(), layer, entry_ids))

    def index_queries(self, x, layer, positions):
        return _straight_through(x, super().index_queries(x.detach(), layer, positions))


class _RoundToStorage(nn.Module):
    """A weight rounded through its storage format (``quantize`` then ``dequantize`` with ``granularity``)."""

    def __init__(self, quantize, dequantize, granularity) -> None:
        super().__init__()
        self.quantize, self.dequantize, self.granularity = quantize, dequantize, granularity

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            codes, scale = self.quantize(weight.detach().float(), self.granularity)
            rounded = self.dequantize(codes, scale, self.granularity)
        return _straight_through(weight, rounded)


def round_weights_straight_through(model: nn.Module, storage_format) -> int:
    """Parametrize every weight the release stores as FP8 / FP4; returns how many were parametrized.

    ``storage_format(name)`` is 'fp8', 'fp4' or anything else (left alone).
    """
    quantization = model.config.quantization
    count = 0
    for name, _ in list(model.named_parameters()):
        kind = storage_format(name)
        if kind not in ("fp8", "fp4") or not name.endswith(".weight"):
            continue
        module = model.get_submodule(name[: -len(".weight")])
        if kind == "fp8":
            rounding = _RoundToStorage(quantize_fp8_blockwise, dequantize_fp8_blockwise, quantization.weight_block_size)
        else:
            rounding = _RoundToStorage(quantize_fp4, dequantize_fp4, quantization.fp4_group_size)
        parametrize.register_parametrization(module, "weight", rounding)
        count += 1
    return count


def remove_weight_rounding(model: nn.Module) -> None:
    """Back to plain parameters (the unrounded values; the export rounds them exactly as the forward did)."""
    for module in list(model.modules()):
        if parametrize.is_parametrized(module):
            for tensor_name in list(module.parametrizations):
                parametrize.remove_parametrizations(module, tensor_name, leave_parametrized=False)
