"""How many blocks a model's cache holds, whichever cache the model builds.

The engine sizes every cache the same way: the configured ``num_cache_blocks``, else a byte budget
(``cache_memory_bytes``), else the free GPU memory on CUDA, else a CPU default, minus what the state slots
cost. What differs between model families (the cache class, the rule for a valid block size, the byte
accounting) the model answers through its contract (:class:`~dsinfer.models.served.ServedModel`), so the
runner never branches on the model's type.
"""

from __future__ import annotations

import torch

from dsinfer.config import EngineConfig
from dsinfer.models.served import CachePlan, EngineCache, ServedModel

__all__ = [
    "CachePlan",
    "EngineCache",
    "ServedModel",
    "cache_blocks_for_budget",
    "check_served_model",
]

CPU_CACHE_BYTES = 512 * 2**20


def check_served_model(model: object) -> None:
    """Reject anything that does not implement the served-model contract, naming what it got."""
    if not isinstance(model, ServedModel):
        raise ValueError(
            f"the engine serves DeepseekV4 and DeepseekV41 models (dsinfer.models.loader.load_model builds them), "
            f"got {type(model).__name__}"
        )


def cache_blocks_for_budget(model: ServedModel, engine: EngineConfig, num_slots: int, block_tokens: int) -> int:
    """How many compressed-cache blocks fit beside ``num_slots`` state slots in the engine's budget."""
    if engine.num_cache_blocks is not None:
        return engine.num_cache_blocks
    with_drafter = engine.speculative_config is not None
    plan = CachePlan(0, 0, block_tokens, "meta", with_drafter, engine.kv_cache_dtype)
    probe = model.build_cache(plan)  # byte accounting only: no memory
    budget = engine.cache_memory_bytes
    if budget is None:
        device = torch.device(engine.device)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(free - total * (1 - engine.gpu_memory_utilization))
        else:
            budget = CPU_CACHE_BYTES
    available = budget - num_slots * probe.slot_bytes()
    if available <= 0:
        return 0
    return max(0, available // max(probe.block_bytes(), 1) - probe.spare_blocks)
