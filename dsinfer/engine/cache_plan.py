"""Which cache a model gets and how many blocks it holds: V4's ``KVCache`` or V4.1's ``KVCacheV41``.

The engine sizes every cache the same way: the configured ``num_cache_blocks``, else a byte budget
(``cache_memory_bytes``), else the free GPU memory on CUDA, else a CPU default, minus what the state slots
cost. The model families differ only in the cache class, the rule for a valid block size and the byte
accounting, so those three live here behind one interface and the runner never branches on the model type.
"""

from __future__ import annotations

import torch

from dsinfer.config import EngineConfig
from dsinfer.kv.cache_v4 import KVCache, attention_layer_ratios, block_tokens_for
from dsinfer.kv.cache_v41 import KVCacheV41, block_tokens_for_v41
from dsinfer.models.deepseek_v4 import DeepseekV4
from dsinfer.models.deepseek_v41 import DeepseekV41

ServedModel = DeepseekV4 | DeepseekV41  # the model families the engine runs
EngineCache = KVCache | KVCacheV41

CPU_CACHE_BYTES = 512 * 2**20


def check_served_model(model: object) -> None:
    """Reject anything the engine has no cache for, naming what it got."""
    if not isinstance(model, DeepseekV4 | DeepseekV41):
        raise ValueError(
            f"the engine serves DeepseekV4 and DeepseekV41 models (dsinfer.models.loader.load_model builds them), "
            f"got {type(model).__name__}"
        )


def cache_block_tokens(model: ServedModel, requested: int | None) -> int:
    """Positions per block: ``requested`` if the model's compression ratios allow it, else the model's default.

    V4's blocks must be a multiple of every layer's ratio; V4.1's only of its KV sources' ratios (and default
    to 64 positions, since its ratios are small). Both raise ``ValueError`` naming ``block_tokens``.
    """
    if isinstance(model, DeepseekV41):
        return block_tokens_for_v41(model.config, requested)
    return block_tokens_for(model.config, requested)


def build_cache(
    model: ServedModel,
    num_slots: int,
    num_blocks: int,
    block_tokens: int,
    device: torch.device | str,
    with_drafter: bool = False,
) -> EngineCache:
    """The cache the model's layers read and write through the batch metadata; ``with_drafter`` adds the
    drafter's state for speculative decoding: the window rings of V4's MTP layers, or V4.1's DSpark rings."""
    dtype = model.embed.weight.dtype
    if isinstance(model, DeepseekV41):
        # The trained-in rounding makes every cached value exactly representable in its FP8 / FP4 format,
        # so the cache keeps codes and scales (3.6x fewer bytes per token than bf16); with the rounding
        # off (testing only) it keeps plain values.
        return KVCacheV41(model.config, num_slots, num_blocks, block_tokens, dtype, device, with_dspark=with_drafter,
                          quantized_storage=model.fake_quantization)  # fmt: skip
    ratios = attention_layer_ratios(model.config, with_mtp=with_drafter)
    return KVCache(model.config, ratios, num_slots, num_blocks, block_tokens, dtype, device)


def cache_blocks_for_budget(model: ServedModel, engine: EngineConfig, num_slots: int, block_tokens: int) -> int:
    """How many compressed-cache blocks fit beside ``num_slots`` state slots in the engine's budget."""
    if engine.num_cache_blocks is not None:
        return engine.num_cache_blocks
    with_drafter = engine.speculative_config is not None
    probe = build_cache(model, 0, 0, block_tokens, "meta", with_drafter)  # byte accounting only: no memory
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
