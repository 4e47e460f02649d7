"""Routed experts beyond the GPU's room kept in host memory in checkpoint form and fetched on use.

:mod:`~dsinfer.offload.stats` counts each layer's routing on the device and persists it;
:mod:`~dsinfer.offload.arena` holds the device's expert slots and each layer's expert -> slot table;
:mod:`~dsinfer.offload.install` turns a loaded model's layers into offloaded ones. The MoE layer asks its
:class:`~dsinfer.offload.arena.LayerResidency` for the slot table before running the ``routed_moe`` op.
"""

from dsinfer.offload.arena import ExpertArena, LayerResidency
from dsinfer.offload.install import ExpertOffload, install_expert_offload
from dsinfer.offload.stats import ExpertStats, ExpertStatsError

__all__ = [
    "ExpertArena",
    "ExpertOffload",
    "ExpertStats",
    "ExpertStatsError",
    "LayerResidency",
    "install_expert_offload",
]
