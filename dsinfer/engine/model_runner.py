"""Runs the model for one scheduled step: builds the packed batch over the engine's cache, returns logits."""

from __future__ import annotations

import math

import torch

from dsinfer.config import EngineConfig
from dsinfer.engine.kv_cache import KVCache, attention_layer_ratios, block_tokens_for
from dsinfer.engine.scheduler import ScheduledSequence
from dsinfer.models.batch import PackedBatch, SequenceSpan
from dsinfer.models.deepseek_v4 import DeepseekV4

CPU_CACHE_BYTES = 512 * 2**20


def cache_blocks_for_budget(model: DeepseekV4, engine: EngineConfig, num_slots: int, block_tokens: int) -> int:
    """How many compressed-cache blocks fit: a configured byte budget, or free GPU memory on CUDA."""
    if engine.num_cache_blocks is not None:
        return engine.num_cache_blocks
    probe = KVCache(model.config, attention_layer_ratios(model.config, False), 0, 0, block_tokens,
                    model.embed.weight.dtype, "meta")  # fmt: skip
    layout = probe.layout
    budget = engine.cache_memory_bytes
    if budget is None:
        device = torch.device(engine.device)
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            budget = int(free - total * (1 - engine.gpu_memory_utilization))
        else:
            budget = CPU_CACHE_BYTES
    available = budget - num_slots * layout.slot_bytes()
    if available <= 0:
        return 0
    return available // max(layout.block_bytes(), 1)


class ModelRunner:
    def __init__(self, model: DeepseekV4, engine: EngineConfig, max_model_len: int) -> None:
        if not isinstance(model, DeepseekV4):
            raise ValueError(
                f"the engine does not serve {type(model).__name__} checkpoints yet (the V4.1 model runs through "
                "dsinfer.models.deepseek_v41 with its own cache, dsinfer.engine.kv_cache_v41)"
            )
        self.model = model
        self.device = torch.device(engine.device)
        config = model.config
        self.block_tokens = block_tokens_for(config, engine.block_tokens)
        num_blocks = cache_blocks_for_budget(model, engine, engine.max_num_seqs, self.block_tokens)
        needed = math.ceil(max_model_len / self.block_tokens)
        if num_blocks < needed:
            raise ValueError(
                f"cache budget too small: {num_blocks} blocks of {self.block_tokens} tokens cannot hold one sequence "
                f"of max_model_len {max_model_len} ({needed} blocks); raise the cache budget or lower max_model_len"
            )
        self.cache = KVCache(
            config, attention_layer_ratios(config, False), engine.max_num_seqs, num_blocks, self.block_tokens,
            model.embed.weight.dtype, self.device,
        )  # fmt: skip

    @property
    def num_blocks(self) -> int:
        return self.cache.num_blocks

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledSequence]) -> torch.Tensor:
        """Compute the scheduled tokens; logits [k, vocab] for the k sequences whose last token ran."""
        ids, positions, spans, sample_rows = [], [], [], []
        offset = 0
        for item in scheduled:
            seq, start, count = item.seq, item.seq.num_computed, item.num_new_tokens
            ids += seq.token_ids[start : start + count]
            positions += range(start, start + count)
            spans.append(SequenceSpan(start, count, seq.slot, seq.block_table, seq.reuse_below, seq.window_from))
            offset += count
            if item.completes_sequence:
                sample_rows.append(offset - 1)
        batch = PackedBatch(
            torch.tensor(ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            spans,
            self.cache,
        )
        return self.model(batch, logits_for=torch.tensor(sample_rows, dtype=torch.long, device=self.device))
