"""Routed experts beyond the GPU's room kept in host memory in checkpoint form and fetched on use.

:mod:`~dsinfer.offload.stats` counts each layer's routing on the device and persists it;
:mod:`~dsinfer.offload.host_store` keeps a layer's experts in host memory; :mod:`~dsinfer.offload.arena` holds the
device's expert slots; :mod:`~dsinfer.offload.residency` keeps each layer's expert -> slot table and fetches its
misses on the device; :mod:`~dsinfer.offload.install` turns a loaded model's layers into offloaded ones. The MoE
layer asks its :class:`~dsinfer.offload.residency.LayerResidency` to stage the step's experts before running
the ``routed_moe`` op.
"""

from dsinfer.offload.arena import ExpertArena
from dsinfer.offload.host_store import HostStore
from dsinfer.offload.install import ExpertOffload, install_expert_offload
from dsinfer.offload.residency import LayerResidency
from dsinfer.offload.stats import ExpertStats, ExpertStatsError

__all__ = [
    "ExpertArena",
    "ExpertOffload",
    "ExpertStats",
    "ExpertStatsError",
    "HostStore",
    "LayerResidency",
    "install_expert_offload",
]
