"""The DSpark drafter: V4.1's draft stages propose the next K tokens of every drafting sequence as one block.

The target forward captures the mean residual streams entering ``dspark_target_layer_ids`` at every position
(:meth:`~dsinfer.models.deepseek_v41.DeepseekV41.forward_for_drafter`). After judging, the stages'
rings (one ``sliding_window``-slot ring of keys per stage and state slot, in the engine cache) take the
positions the step kept: prefill chunks whole, verify spans only up to their last accepted draft, so no
rejected position ever reaches a ring and there is nothing to roll back there. Then every sampled sequence
drafts one block ``[bonus token, noise, ...]`` after its last kept position, all sequences at once
(:func:`~dsinfer.models.dspark.draft_blocks`), as the stages were trained (``dsinfer.training.draft_loss``):
column ``i`` is biased by the Markov head of column ``i - 1``'s draft and the draft is its argmax (a one-hot
draft distribution for :mod:`dsinfer.speculative.rejection`), so drafting is sequential over the block.

**How many drafts are verified.** K = ``num_speculative_tokens`` (at most ``dspark_block_size``) columns are
drafted. With ``confidence_threshold`` t > 0, only the leading drafts whose confidence ``sigmoid(c_i) >= t``
are verified (the first draft below t and every draft after it are dropped): the confidence head is trained to
predict that every draft up to column i is right, so ``sigmoid(c_i)`` estimates the chance that verifying
draft i adds a token. t = 0 (the default) verifies all K. Either way verification is exact: greedy requests get
plain decoding's tokens, sampled ones the target distribution.

A fixed-width verify step (:mod:`dsinfer.kv.fixed_width`, what a CUDA graph replays) seeds and drafts from
device tensors alone (:meth:`DSparkDrafter.draft_fixed`): every column of the step is seeded, a sequence's
rejected columns into the cache's spare slot, so its rings again hold kept positions only.
"""

from __future__ import annotations

import torch

from dsinfer.kv.batch import host_to_device
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.kv.fixed_width import FixedWidthBatch
from dsinfer.models.deepseek_v41 import DeepseekV41
from dsinfer.models.dspark import draft_blocks, seed_ring_rows
from dsinfer.speculative.drafting import DraftInput


def verified_draft_counts(confidence: torch.Tensor, threshold: float) -> torch.Tensor:
    """How many leading drafts of each block [B, K] to verify: those up to the first with ``sigmoid < threshold``."""
    if threshold <= 0:
        return torch.full(confidence.shape[:1], confidence.shape[1], dtype=torch.long, device=confidence.device)
    sure = torch.sigmoid(confidence) >= threshold
    return sure.long().cumprod(dim=-1).sum(dim=-1)


class DSparkDrafter:
    """Drafts with ``model.mtp`` (the DSpark stages) over the engine cache's DSpark rings."""

    def __init__(
        self, model: DeepseekV41, cache: KVCacheV41, num_tokens: int, confidence_threshold: float = 0.0
    ) -> None:
        cfg = model.config
        if not len(model.mtp):
            raise ValueError("the model has no DSpark stages to draft with")
        if len(cache.dspark_rings) != len(model.mtp):
            raise ValueError("the engine cache has no DSpark rings for the stages (build it with_dspark)")
        if not 1 <= num_tokens <= cfg.dspark_block_size:
            raise ValueError(f"num_tokens: expected 1 to the block size {cfg.dspark_block_size}, got {num_tokens}")
        self.model, self.cache, self.num_tokens = model, cache, num_tokens
        self.confidence_threshold = confidence_threshold
        self.window = cfg.sliding_window

    @torch.inference_mode()
    def draft(self, inputs: DraftInput) -> list[list[int]]:
        """Seed the rings with the kept positions, then draft a block for each drafting span."""
        if not inputs.spans:
            return []
        self._seed(inputs)
        if not inputs.drafting:
            return []
        device = inputs.next_token_ids.device
        last_rows = host_to_device(inputs.last_rows(), torch.long, device)
        slots = host_to_device([inputs.spans[i].slot for i in inputs.drafting], torch.long, device)
        blocks = draft_blocks(self.model, self.cache.dspark_rings, slots, inputs.positions[last_rows],
                              inputs.next_token_ids[last_rows], columns=self.num_tokens)  # fmt: skip
        counts = verified_draft_counts(blocks.confidence, self.confidence_threshold)
        drafts = torch.cat([blocks.tokens, counts[:, None]], dim=1).tolist()  # one host read for both
        return [row[: row[-1]] for row in drafts]

    def draft_fixed(
        self, batch: FixedWidthBatch, features: torch.Tensor, next_token_ids: torch.Tensor, kept: torch.Tensor
    ) -> torch.Tensor:
        """Seed the rings with the kept columns and draft a block per sequence: [B, num_tokens + 1], the last
        column how many leading drafts to verify. No value is read on the host."""
        model, width = self.model, batch.width
        if width > self.window:
            raise ValueError(f"a fixed-width step of {width} positions overruns the DSpark rings ({self.window})")
        kept_columns = torch.arange(width, device=kept.device)[None, :] < kept[:, None]
        slots = torch.where(kept_columns, batch.slots[:, None], batch.spare_slot)  # rejected: the spare slot
        seed_ring_rows(model.mtp, self.cache.dspark_rings, slots.flatten(), features, batch.positions.flatten(),
                       model.rope.window, model.quantizer)  # fmt: skip
        last = kept - 1
        bonus = next_token_ids.gather(1, last[:, None])[:, 0]
        blocks = draft_blocks(model, self.cache.dspark_rings, batch.slots, batch.starts + last, bonus,
                              columns=self.num_tokens)  # fmt: skip
        counts = verified_draft_counts(blocks.confidence, self.confidence_threshold)
        return torch.cat([blocks.tokens, counts[:, None]], dim=1)

    def _seed(self, inputs: DraftInput) -> None:
        """Write every span's last ``sliding_window`` kept positions (the only ones a draft can still see)."""
        rows, slots, offset = [], [], 0
        for span in inputs.spans:
            count = min(span.length, self.window)
            rows += range(offset + span.length - count, offset + span.length)
            slots += [span.slot] * count
            offset += span.length
        device = inputs.target_hidden.device
        rows = host_to_device(rows, torch.long, device)
        model = self.model
        seed_ring_rows(model.mtp, self.cache.dspark_rings, host_to_device(slots, torch.long, device),
                       inputs.target_hidden[rows], inputs.positions[rows], model.rope.window,
                       model.quantizer)  # fmt: skip
