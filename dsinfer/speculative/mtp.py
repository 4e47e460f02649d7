"""The MTP drafter: V4's multi-token-prediction layer proposes the next K tokens of every drafting sequence.

After a step's target forward the layer runs over every position the step kept (prefill chunks, accepted
drafts), each with the target's residual streams there and the embedding of the token that follows; this keeps
the layer's own window ring current, and the last row of each sampled sequence drafts its first token. Further
drafts chain the layer on its own output streams, one position at a time (vLLM's and SGLang's way when a
checkpoint has fewer MTP layers than drafts). Those chained positions are written into the layer's ring for
the later chain steps to attend to and put back afterwards: the next step runs them again with the target's
streams. Drafts are the layer's argmax (a one-hot draft distribution for :mod:`dsinfer.speculative.rejection`),
over every token id, or over a ``draft_token_map``'s ids only (then each draft reads only their rows of the head).

A fixed-width verify step (:mod:`dsinfer.kv.fixed_width`, what a CUDA graph replays) drafts the same way
from device tensors alone (:meth:`MTPDrafter.draft_fixed`): the layer runs every column of the step, a
sequence's rejected columns in the cache's spare slot (so only kept positions reach its ring), and the chain
starts from each sequence's last kept column.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from dsinfer.config import ConfigError
from dsinfer.kv.batch import PackedBatch, SequenceSpan, host_to_device
from dsinfer.kv.cache_v4 import KVCache
from dsinfer.kv.fixed_width import FixedWidthBatch
from dsinfer.models.deepseek_v4 import DeepseekV4
from dsinfer.speculative.drafting import DraftInput


class MTPDrafter:
    """Drafts with ``model.mtp[0]`` over the engine cache (which must hold the MTP layer's window ring);
    ``token_map``: the token ids it may draft (None: all)."""

    def __init__(self, model: DeepseekV4, cache: KVCache, num_tokens: int, token_map: list[int] | None = None) -> None:
        if not len(model.mtp):
            raise ValueError("the model has no MTP layer to draft with")
        self.model, self.cache, self.num_tokens = model, cache, num_tokens
        self.layer = model.mtp[0]
        if len(cache.layers) <= self.layer.layer_id:
            raise ValueError("the engine cache has no window ring for the MTP layer (build it with_mtp)")
        self.draft_ids, self.draft_head = None, None
        if token_map is not None:
            weight = model.head.weight
            if max(token_map) >= weight.shape[0]:
                raise ConfigError(
                    f"speculative_config 'draft_token_map': token id {max(token_map)} is outside the model's "
                    f"vocabulary of {weight.shape[0]}"
                )
            self.draft_ids = torch.tensor(token_map, dtype=torch.long, device=weight.device)
            self.draft_head = weight[self.draft_ids].contiguous()  # the map's rows, read by every draft

    def _draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's draft: the head's argmax, over the map's ids only when there is one."""
        if self.draft_head is None:
            return self.model.head(hidden).float().argmax(-1)
        return self.draft_ids[F.linear(hidden, self.draft_head).float().argmax(-1)]

    @torch.inference_mode()
    def draft(self, inputs: DraftInput) -> list[list[int]]:
        """Run the kept positions through the MTP layer and draft ``num_tokens`` for each drafting span."""
        model, layer = self.model, self.layer
        if not inputs.spans:
            return []
        batch = PackedBatch(inputs.next_token_ids, inputs.positions, inputs.spans, self.cache)
        embedded = model.embed(inputs.next_token_ids)
        streams = layer.draft_streams(inputs.target_hidden, embedded, inputs.next_token_ids, batch, model.rope.window)
        if not inputs.drafting:
            return []
        device = streams.device
        streams = streams[host_to_device(inputs.last_rows(), torch.long, device)]
        token = self._draft_tokens(layer.collapse(streams))
        drafts = [token]
        spans = [inputs.spans[i] for i in inputs.drafting]
        next_positions = [span.start + span.length for span in spans]  # where each bonus token sits
        if self.num_tokens > 1:
            ring = self.cache.layers[layer.layer_id].window
            written = self._ring_index(ring, spans, next_positions)
            saved = ring[written].clone()
            for depth in range(1, self.num_tokens):
                chain_spans = [
                    SequenceSpan(p + depth - 1, 1, s.slot, s.block_table, 0, s.window_from)
                    for s, p in zip(spans, next_positions, strict=True)
                ]
                positions = host_to_device([p + depth - 1 for p in next_positions], torch.long, device)
                chain = PackedBatch(token, positions, chain_spans, self.cache)
                streams = layer.draft_streams(streams, model.embed(token), token, chain, model.rope.window)
                token = self._draft_tokens(layer.collapse(streams))
                drafts.append(token)
            ring[written] = saved
        return torch.stack(drafts, dim=1).tolist()  # the drafter's one host read

    def draft_fixed(
        self, batch: FixedWidthBatch, features: torch.Tensor, next_token_ids: torch.Tensor, kept: torch.Tensor
    ) -> torch.Tensor:
        """Drafts [B, num_tokens + 1] after a fixed-width verify (the last column: ``num_tokens``, all verified).

        ``features`` are the verify's streams [B * width, hc, hidden]; sequence ``b`` kept its first ``kept[b]``
        positions and ``next_token_ids[b, j]`` is the token after position ``j``. The layer runs every position
        (per-token work over all rows, attention column by column), the rejected ones in the spare slot; the
        chain starts from each sequence's last kept position. No value is read on the host."""
        model, layer, size = self.model, self.layer, batch.size
        window = model.rope.window
        kept_columns = torch.arange(batch.width, device=kept.device)[None, :] < kept[:, None]
        drafting = replace(batch, input_ids=next_token_ids,
                           row_slots=torch.where(kept_columns, batch.slots[:, None], batch.spare_slot))  # fmt: skip
        ids = next_token_ids.flatten()
        # Per-token work over all rows, the attention column by column (a window-only layer: no journal).
        streams = layer.draft_streams(features, model.embed(ids), ids, drafting.packed(), window)
        sequences = torch.arange(size, device=kept.device)
        streams = streams.reshape(size, batch.width, *streams.shape[1:])[sequences, kept - 1]
        token = self._draft_tokens(layer.collapse(streams))
        drafts = [token]
        if self.num_tokens > 1:
            ring = self.cache.layers[layer.layer_id].window
            next_positions = batch.starts + kept  # where each bonus token sits
            steps = torch.arange(self.num_tokens - 1, device=kept.device)
            rows = (next_positions[:, None] + steps) % ring.shape[1]
            written = (batch.slots[:, None].expand_as(rows), rows)
            saved = ring[written].clone()
            for depth in range(1, self.num_tokens):
                chain = batch.decode_batch(next_positions + depth - 1, token)
                streams = layer.draft_streams(streams, model.embed(token), token, chain, window)
                token = self._draft_tokens(layer.collapse(streams))
                drafts.append(token)
            ring[written] = saved
        counts = torch.full((size, 1), self.num_tokens, dtype=torch.long, device=kept.device)
        return torch.cat([torch.stack(drafts, dim=1), counts], dim=1)

    def _ring_index(self, ring: torch.Tensor, spans: list[SequenceSpan], next_positions: list[int]):
        """(slots, ring rows) the chain steps write: positions next .. next + num_tokens - 2 of every span."""
        width = ring.shape[1]
        steps = self.num_tokens - 1
        slots = [s.slot for s in spans for _ in range(steps)]
        rows = [(p + d) % width for p in next_positions for d in range(steps)]
        return host_to_device(slots, torch.long, ring.device), host_to_device(rows, torch.long, ring.device)
