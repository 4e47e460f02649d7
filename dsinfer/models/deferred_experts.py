"""Routed experts left in the shards while the rest of a model loads, read later one expert at a time.

``load_model(..., expert_device="meta")`` does not read the backbone MoE layers' routed experts with the other
weights: it records where each expert's tensors sit (:class:`DeferredExperts`), gives each layer shapes-only
(meta) stacked weights, and hands the record to the model as ``model.deferred_experts``. The expert offload
(:mod:`dsinfer.offload.streaming`) then chooses where every expert lives, a GPU slot or a pinned host row,
allocates exactly those rows and reads each expert once straight into its row. So a layer's experts never exist
whole in host memory: V4-Flash's 147 GB of packed FP4 experts load beside 128 GiB of RAM when the GPU keeps the
rest. The drafter's (MTP) experts are not deferred: they stay resident and load with the model.

Reading goes through the loader's own checks and dequantisation (``reader``: one stored tensor, or one expert's
row of a Hugging Face stacked tensor), so a deferred expert lands in the same form an eager load stacks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dsinfer.models.expert_packing import ROUTED_EXPERT, ExpertPackingError
from dsinfer.ops.moe import ExpertWeights
from dsinfer.ops.quant import FP4_GROUP

DEFERRED_MOE = re.compile(r"^layers\.\d+\.ffn$")  # backbone MoE layers (the drafter's experts load eagerly)
WHICH = ("w1", "w3", "w2")


class ExpertPartReader(Protocol):
    """Reads one deferred tensor: ``part`` a per-expert weight as served (FP4 bytes and scale, or floats with
    scale None), ``row`` one expert's slice of a stacked float tensor."""

    def part(self, key: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def row(self, key: str, index: int) -> torch.Tensor: ...

    def close(self) -> None: ...


@dataclass
class _DeferredLayer:
    experts: list[int]  # global expert ids in stacking order (an EP rank's own, or all)
    intermediate: int = 0
    hidden: int = 0
    parts: dict[tuple[str, int], str] = field(default_factory=dict)  # (which, expert) -> stored key
    fp4: set[bool] = field(default_factory=set)  # the formats seen (packed FP4 or floats)
    fused: dict[str, str] = field(default_factory=dict)  # 'gate_up_proj' / 'down_proj' -> stored key


class DeferredExperts:
    """Where every deferred routed expert is stored, by MoE layer path; reads one expert into a stacked row."""

    def __init__(self, reader: ExpertPartReader, dtype: torch.dtype) -> None:
        self.reader, self.dtype = reader, dtype
        self.layers: dict[str, _DeferredLayer] = {}

    @staticmethod
    def defers(name: str) -> bool:
        """Whether the routed-expert weight ``name`` belongs to a layer whose experts are deferred."""
        match = ROUTED_EXPERT.match(name)
        return match is not None and DEFERRED_MOE.match(match["moe"]) is not None

    def layer(self, moe: str, experts: list[int], target_w1: tuple[int, ...]) -> _DeferredLayer:
        """The record of layer ``moe`` (created with its stacking order and ``w1``'s ``[I, H]`` shape)."""
        if moe not in self.layers:
            self.layers[moe] = _DeferredLayer(list(experts), *target_w1)
        return self.layers[moe]

    def record(self, name: str, key: str, fp4: bool, experts: list[int], target_w1: tuple[int, ...]) -> None:
        """Expert weight ``name`` is stored under ``key`` (``fp4``: packed bytes with a scale tensor)."""
        match = ROUTED_EXPERT.match(name)
        layer = self.layer(match["moe"], experts, target_w1)
        layer.parts[(match["which"], int(match["expert"]))] = key
        layer.fp4.add(fp4)

    def record_fused(self, moe: str, kind: str, key: str, experts: list[int], target_w1: tuple[int, ...]) -> None:
        """Hugging Face's stacked ``gate_up_proj`` / ``down_proj`` of layer ``moe`` is stored under ``key``."""
        layer = self.layer(moe, experts, target_w1)
        layer.fused[kind] = key
        layer.fp4.add(False)

    def names(self) -> set[str]:
        """The per-expert weight names the record covers (the loader's check for missing tensors)."""
        covered = set()
        for moe, layer in self.layers.items():
            covered |= {f"{moe}.experts.{e}.{which}.weight" for which, e in layer.parts}
            if "gate_up_proj" in layer.fused:
                covered |= {f"{moe}.experts.{e}.{w}.weight" for e in layer.experts for w in ("w1", "w3")}
            if "down_proj" in layer.fused:
                covered |= {f"{moe}.experts.{e}.w2.weight" for e in layer.experts}
        return covered

    def like(self, moe: str) -> ExpertWeights:
        """Layer ``moe``'s stacked experts as shapes only (meta): what its MoE serves until they are read."""
        layer = self.layers[moe]
        if len(layer.fp4) != 1:
            raise ExpertPackingError(f"{moe}: some routed experts are packed FP4 and some are not")
        rows, inter, hidden = len(layer.experts), layer.intermediate, layer.hidden

        def empty(*shape: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
            return torch.empty((rows, *shape), dtype=dtype, device="meta")

        if True in layer.fp4:
            return ExpertWeights(empty(2 * inter, hidden // 2), empty(2 * inter, hidden // FP4_GROUP),
                                 empty(hidden, inter // 2), empty(hidden, inter // FP4_GROUP), inter, True)  # fmt: skip
        return ExpertWeights(empty(2 * inter, hidden, dtype=self.dtype), None,
                             empty(hidden, inter, dtype=self.dtype), None, inter, False)  # fmt: skip

    def read_into(self, moe: str, index: int, target: ExpertWeights, row: int) -> None:
        """Read expert ``index`` (stacking order) of layer ``moe`` into row ``row`` of ``target``, one stored
        tensor at a time: at most one expert's tensors exist outside ``target`` while it runs."""
        layer = self.layers[moe]
        expert, inter = layer.experts[index], layer.intermediate
        if layer.fused:
            target.w13[row].copy_(self.reader.row(layer.fused["gate_up_proj"], expert))
            target.w2[row].copy_(self.reader.row(layer.fused["down_proj"], expert))
            return
        places = {"w1": slice(0, inter), "w3": slice(inter, 2 * inter), "w2": slice(None)}
        for which in WHICH:
            codes, scale = self.reader.part(layer.parts[(which, expert)], self._shape(layer, which))
            stacked, stacked_scale = (target.w2, target.w2_scale) if which == "w2" else (target.w13, target.w13_scale)
            stacked[row, places[which]].copy_(codes if scale is None else codes.view(torch.uint8))
            if scale is not None:
                stacked_scale[row, places[which]].copy_(scale.view(torch.uint8))
            del codes, scale

    @staticmethod
    def _shape(layer: _DeferredLayer, which: str) -> tuple[int, int]:
        """The model's shape of one expert weight (``[I, H]`` for w1 / w3, ``[H, I]`` for w2)."""
        return (layer.hidden, layer.intermediate) if which == "w2" else (layer.intermediate, layer.hidden)

    def close(self) -> None:
        """Every expert is read: let go of the shards."""
        self.reader.close()
        self.layers.clear()
