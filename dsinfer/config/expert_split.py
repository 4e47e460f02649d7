"""How a GPU budget for routed experts splits into resident slots and the fetch buffers: the rule the plan
(:mod:`dsinfer.memory_plan`) prints and :mod:`dsinfer.offload.install` applies.

Per layer ``resident`` experts stay on the GPU; ``FETCH_BUFFERS`` buffers shared by all layers, each with room for
one layer's non-resident experts, take the misses of the layer about to run while the layer before computes.
"""

from __future__ import annotations

from dataclasses import dataclass

FETCH_BUFFERS = 2
# The engine's host store keeps every routed expert of the rank (True) or only the offloaded ones (False: a
# re-balance then swaps experts between GPU and host, through the layer's fetch buffer);
# :func:`dsinfer.offload.install_expert_offload`'s default, and what the plan assumes unless told otherwise. The
# engine reads each expert from the checkpoint straight into its GPU slot or host row
# (:mod:`dsinfer.offload.streaming`), so its host holds only the offloaded experts: V4-Flash's 147 GB of experts
# load beside 128 GiB of RAM.
HOST_KEEPS_EVERY_EXPERT = False
# Fetch-ahead (the next layer's router run on this layer's MoE input, its predicted misses copied on the copy
# stream) is on by default only where fewer than this share of a layer's experts are resident. On one H100, at
# 1 request with 80% resident and a Zipf-skewed router (benchmarks/expert_offload.py, docs/perf.md), it fetched
# 0.3% of the misses ahead and cost 0.23 ms a layer: decode 2.17x all-resident with it, 1.47x without.
FETCH_AHEAD_BELOW_RESIDENT_SHARE = 0.5


def fetch_ahead_by_default(resident: int, per_layer: int) -> bool:
    """Whether fetch-ahead is on when the caller does not say (:data:`FETCH_AHEAD_BELOW_RESIDENT_SHARE`)."""
    return resident < FETCH_AHEAD_BELOW_RESIDENT_SHARE * per_layer


@dataclass(frozen=True)
class ExpertSplit:
    """Routed experts of one rank: how many of each layer's stay on the GPU, and the fetch pool for the rest."""

    per_layer: int  # the rank's experts per layer
    resident: int  # of them, on the GPU per layer
    layers: int
    expert: int  # bytes of one expert

    @property
    def offloaded(self) -> int:
        return self.per_layer - self.resident

    @property
    def fetch_slots(self) -> int:
        return FETCH_BUFFERS * self.offloaded if self.offloaded else 0

    @property
    def gpu_bytes(self) -> int:
        return (self.layers * self.resident + self.fetch_slots) * self.expert

    @property
    def host_bytes(self) -> int:
        """The host store keeps every expert of the rank (a re-balance promotes any of them)."""
        return self.layers * self.per_layer * self.expert if self.offloaded else 0

    @property
    def offloaded_host_bytes(self) -> int:
        """A host store of only the offloaded experts (a re-balance swaps experts between GPU and host)."""
        return self.layers * self.offloaded * self.expert


def largest_split(per_layer: int, layers: int, expert: int, budget: int) -> ExpertSplit | None:
    """The most resident experts per layer whose slots and fetch buffers fit ``budget`` bytes; None if even the
    fetch buffers alone do not."""
    for resident in range(per_layer, -1, -1):
        split = ExpertSplit(per_layer, resident, layers, expert)
        if split.gpu_bytes <= budget:
            return split
    return None
