"""CED bounded prefill: which tokens of a packed batch run the decoder layers, and which only feed its global KV.

DeepSeek-V4.1's last KV source is a ratio-1 compressor (the first decoder layer). Its entries, one per
position, are the decoder's global KV; they depend only on the encoder's output at each position. So a
prompt's positions before ``decoder_from`` (the prompt's last ``replay_tokens``, DeepInfer's 140) need only
the encoder layers and that compressor; the decoder layers run from ``decoder_from`` on, with their windows
starting there (:attr:`~dsinfer.kv.batch.SequenceSpan.decoder_from`). The split depends on positions alone,
so a prompt gives the same cache in one piece or in chunks, and a decode step (every position past the
prompt) runs every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.kv.batch import PackedBatch, SequenceSpan, host_to_device


@dataclass
class DecoderSplit:
    """The two sub-batches of a bounded forward, each with its rows in the packed batch."""

    skipped: PackedBatch | None  # tokens that only feed the first decoder layer's compressor (None: no such token)
    skipped_rows: torch.Tensor | None
    decoded: PackedBatch | None  # tokens the decoder layers run over (None: none this step)
    decoded_rows: torch.Tensor | None
    row_in_decoded: torch.Tensor  # [T]: each packed row's row in ``decoded``, -1 for skipped rows


def skips_decoder(batch: PackedBatch) -> bool:
    """Whether any token of ``batch`` lies before its span's ``decoder_from``."""
    return any(span.decoder_from > span.start for span in batch.spans)


def split_at_decoder(batch: PackedBatch) -> DecoderSplit:
    """Each span cut at ``decoder_from``: the part before it (compressor only) and the rest (decoder layers)."""
    skipped_spans, skipped_rows, decoded_spans, decoded_rows = [], [], [], []
    row_in_decoded = [-1] * batch.num_tokens
    for span, tokens in zip(batch.spans, batch.sequence_slices(), strict=True):
        end = span.start + span.length
        first = min(max(span.start, span.decoder_from), end)
        if first > span.start:
            skipped_spans.append(SequenceSpan(span.start, first - span.start, span.slot, span.block_table,
                                              span.reuse_below, span.window_from))  # fmt: skip
            skipped_rows += range(tokens.start, tokens.start + first - span.start)
        if end > first:
            rows = range(tokens.start + first - span.start, tokens.stop)
            for row in rows:
                row_in_decoded[row] = len(decoded_rows) + row - rows.start
            decoded_rows += rows
            decoded_spans.append(SequenceSpan(first, end - first, span.slot, span.block_table, span.reuse_below,
                                              max(span.window_from, span.decoder_from)))  # fmt: skip
    device = batch.input_ids.device

    def sub_batch(spans: list[SequenceSpan], rows: list[int]) -> tuple[PackedBatch | None, torch.Tensor | None]:
        if not spans:
            return None, None
        index = host_to_device(rows, torch.long, device)
        return PackedBatch(batch.input_ids[index], batch.positions[index], spans, batch.cache), index

    skipped, skipped_index = sub_batch(skipped_spans, skipped_rows)
    decoded, decoded_index = sub_batch(decoded_spans, decoded_rows)
    return DecoderSplit(skipped, skipped_index, decoded, decoded_index,
                        host_to_device(row_in_decoded, torch.long, device))  # fmt: skip
