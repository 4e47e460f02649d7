"""Routed experts from a checkpoint, kept in its precision and stacked per layer (never dequantised on load).

The loader hands every ``<moe>.experts.<e>.w{1,2,3}.weight`` it reads to an :class:`ExpertCollector` instead of
materialising it: packed FP4 codes keep their bytes and ue8m0 scales, float experts (Hugging Face-format
checkpoints, fused or not) keep their values in the compute dtype, FP8 experts are dequantised to it. Once the
other weights are in place :meth:`ExpertCollector.pack_into` stacks each layer's experts
(:func:`~dsinfer.ops.moe.stack_experts`) onto the device and gives them to the layer's MoE.

:func:`dequantized_state_dict` goes the other way: the official names (per expert, ``.weight`` for kept FP8
linears) with float values, for exporting and for comparing against a reference implementation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from dsinfer.layers.fp8_linear import Fp8Linear
from dsinfer.layers.moe import MoE
from dsinfer.ops.moe import ExpertWeights, dequantize_expert, stack_experts
from dsinfer.ops.quant import dequantize_fp8_blockwise

if TYPE_CHECKING:
    from dsinfer.models.deferred_experts import DeferredExperts

ROUTED_EXPERT = re.compile(r"^(?P<moe>.+\.ffn)\.experts\.(?P<expert>\d+)\.(?P<which>w[123])\.weight$")


class ExpertPackingError(ValueError):
    """The routed experts of a layer cannot be stacked (missing experts, mixed formats)."""


@dataclass
class _LayerExperts:
    weights: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    scales: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)


class ExpertCollector:
    """Routed-expert tensors as the loader reads them, grouped by MoE layer until they are stacked."""

    def __init__(self, owned_experts=None, deferred: DeferredExperts | None = None) -> None:
        """``owned_experts(moe_path)``: the experts an EP rank keeps of that layer, in stacking order (None:
        all of them); the others are never read (:func:`dsinfer.parallel.ep.backbone_expert_filter`).
        ``deferred``: where the backbone layers' experts are recorded instead of read
        (:mod:`dsinfer.models.deferred_experts`); their layers get shapes-only stacks."""
        self._layers: dict[str, _LayerExperts] = {}
        self._owned = owned_experts
        self._skipped: set[str] = set()
        self.deferred = deferred

    def defers(self, name: str) -> bool:
        """Whether routed-expert weight ``name`` is recorded for a later read instead of read now."""
        return self.deferred is not None and self.deferred.defers(name)

    def stacking_order(self, moe: str, n_experts: int) -> list[int]:
        """The experts of layer ``moe`` this rank stacks, in order (all ``n_experts`` without a filter)."""
        owned = self._owned(moe) if self._owned is not None else None
        return list(range(n_experts)) if owned is None else list(owned)

    def wants(self, name: str) -> bool:
        """False for a routed expert this rank does not hold (counted as collected, never read)."""
        match = ROUTED_EXPERT.match(name)
        if match is None or self._owned is None:
            return True
        owned = self._owned(match["moe"])
        if owned is None or int(match["expert"]) in owned:
            return True
        self._skipped.add(name)
        return False

    @staticmethod
    def is_routed_expert(name: str) -> bool:
        return ROUTED_EXPERT.match(name) is not None

    def take(self, name: str, tensor: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Keep one expert weight: FP4 bytes with their scale, or a float tensor (``scale`` None)."""
        match = ROUTED_EXPERT.match(name)
        if match is None:
            raise ValueError(f"{name!r} is not a routed-expert weight")
        if not self.wants(name):
            return
        layer = self._layers.setdefault(match["moe"], _LayerExperts())
        key = (match["which"], int(match["expert"]))
        layer.weights[key] = tensor
        if scale is not None:
            layer.scales[key] = scale

    def collected_names(self) -> set[str]:
        taken = {
            f"{moe}.experts.{e}.{which}.weight" for moe, layer in self._layers.items() for which, e in layer.weights
        }
        return taken | self._skipped | (set() if self.deferred is None else self.deferred.names())

    def drop_modules(self, model: nn.Module) -> None:
        """Remove the per-expert modules of every collected or deferred layer (before the model gets memory)."""
        for moe in [*self._layers, *(self.deferred.layers if self.deferred is not None else ())]:
            _moe_module(model, moe).experts = None

    def pack_into(self, model: nn.Module, device: torch.device | str) -> None:
        """Stack each layer's experts onto ``device`` and hand them to its MoE."""
        for moe, layer in self._layers.items():
            module = _moe_module(model, moe)
            owned = self._owned(moe) if self._owned is not None else None
            experts = range(module.n_experts) if owned is None else owned
            missing = [f"{moe}.experts.{e}.{w}.weight" for e in experts for w in ("w1", "w2", "w3")
                       if (w, e) not in layer.weights]  # fmt: skip
            if missing:
                raise ExpertPackingError(f"missing tensor {missing[0]!r}")
            fp4 = bool(layer.scales)
            if fp4 and len(layer.scales) != len(layer.weights):
                raise ExpertPackingError(f"{moe}: some routed experts are packed FP4 and some are not")

            def column(which: str, source: dict, experts=experts) -> list[torch.Tensor]:
                return [source[(which, e)] for e in experts]

            if fp4:
                stacked = stack_experts(
                    column("w1", layer.weights), column("w3", layer.weights), column("w2", layer.weights),
                    column("w1", layer.scales), column("w3", layer.scales), column("w2", layer.scales),
                )  # fmt: skip
            else:
                stacked = stack_experts(column("w1", layer.weights), column("w3", layer.weights),
                                        column("w2", layer.weights))  # fmt: skip
            module.pack(_to_device(stacked, device), None if owned is None else len(owned))
        self._layers.clear()
        for moe in self.deferred.layers if self.deferred is not None else ():
            like = self.deferred.like(moe)  # shapes only until dsinfer.offload reads the experts
            _moe_module(model, moe).pack(like, like.num_experts)


def _moe_module(model: nn.Module, path: str) -> MoE:
    module = model.get_submodule(path)
    if not isinstance(module, MoE):
        raise ExpertPackingError(f"{path} is not an MoE layer")
    return module


def _to_device(weights: ExpertWeights, device: torch.device | str) -> ExpertWeights:
    def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(device).contiguous()

    return ExpertWeights(
        move(weights.w13), move(weights.w13_scale), move(weights.w2), move(weights.w2_scale),
        weights.intermediate_size, weights.is_fp4,
    )  # fmt: skip


def dequantized_state_dict(model: nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The model's state dict under the official names with float values: routed experts per expert and FP8
    linears dequantised to ``dtype``."""
    state = {}
    packed_prefixes = []
    for path, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            packed_prefixes += [f"{path}.codes", f"{path}.scale"]
            state[f"{path}.weight"] = dequantize_fp8_blockwise(module.codes, module.scale, module.block, dtype=dtype)
        if isinstance(module, MoE) and module.is_packed:
            packed_prefixes.append(f"{path}.routed_")
            weights = module.routed_weights()
            inter = weights.intermediate_size
            for expert in range(weights.num_experts):
                w13, w2 = dequantize_expert(weights, expert, dtype)
                prefix = f"{path}.experts.{expert}"
                state[f"{prefix}.w1.weight"] = w13[:inter]
                state[f"{prefix}.w3.weight"] = w13[inter:]
                state[f"{prefix}.w2.weight"] = w2
    for name, tensor in model.state_dict().items():
        if not name.startswith(tuple(packed_prefixes)):
            state[name] = tensor
    return state


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's weights on their device: routed experts and everything (parameters and buffers)."""
    routed = 0
    for module in model.modules():
        if isinstance(module, MoE):
            routed += (
                module.routed_weights().nbytes
                if module.is_packed
                else sum(p.numel() * p.element_size() for p in module.experts.parameters())
            )
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return {"routed_experts": routed, "all": total}
