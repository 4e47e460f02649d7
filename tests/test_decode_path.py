"""The batched decode path (one token per sequence, device metadata only) against the per-sequence path."""

from __future__ import annotations

import copy

import pytest
import torch

from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v4 import KVCache, attention_layer_ratios, block_tokens_for
from dsinfer.models.loader import load_model


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint, progress=False)


def _decode_step(model, cache, tokens, spans, per_sequence: bool, monkeypatch) -> torch.Tensor:
    batch = PackedBatch(torch.tensor(tokens), torch.tensor([s.start for s in spans]), spans, cache)
    if per_sequence:
        monkeypatch.setattr(PackedBatch, "is_decode", property(lambda self: False))
    try:
        return model(batch)
    finally:
        monkeypatch.undo()


def test_decode_steps_equal_the_per_sequence_path(model, monkeypatch):
    """Sequences at every phase of their compressor windows, with scattered blocks and a late window start."""
    cfg = model.config
    block_tokens = block_tokens_for(cfg)
    cache = KVCache(cfg, attention_layer_ratios(cfg, True), 4, 16, block_tokens, torch.float32, "cpu")
    generator = torch.Generator().manual_seed(3)
    lengths = [37, 64, 3, 95]  # mid-window, at a block edge, before any entry, past the first HCA entry
    tables = [[5, 1], [9, 2, 14], [0], [3, 11, 7, 12]]
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in lengths]
    for slot, (prompt, table) in enumerate(zip(prompts, tables, strict=True)):
        model(
            PackedBatch(
                torch.tensor(prompt), torch.arange(len(prompt)), [SequenceSpan(0, len(prompt), slot, table)], cache
            )
        )
    for step in range(9):  # crosses window completions of both ratios
        spans = [SequenceSpan(n + step, 1, slot, tables[slot]) for slot, n in enumerate(lengths)]
        tokens = torch.randint(3, 500, (len(spans),), generator=generator).tolist()
        reference_cache = copy.deepcopy(cache)
        expected = _decode_step(model, reference_cache, tokens, spans, True, monkeypatch)
        got = _decode_step(model, cache, tokens, spans, False, monkeypatch)
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (step, (got - expected).abs().max())
        for ours, theirs in zip(cache.layers, reference_cache.layers, strict=True):
            assert torch.allclose(ours.window, theirs.window, atol=1e-6)
            for mine, ref in ((ours.compressor, theirs.compressor), (ours.indexer, theirs.indexer)):
                if mine is not None:  # the pool's blocks; the trash block may differ
                    assert torch.allclose(mine.entries[: cache.num_blocks], ref.entries[: cache.num_blocks], atol=1e-6)


def test_prefill_in_query_blocks_equals_one_block(model, monkeypatch):
    """Long prompts attend in blocks of queries, each to the window keys it can see: the same logits."""
    import dsinfer.ops.sparse_attention.prefill_reference as attention

    tokens = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(9)).tolist()
    monkeypatch.setattr(attention, "QUERY_CHUNK", 10_000)
    whole = model(PackedBatch.from_sequences([tokens]))
    monkeypatch.setattr(attention, "QUERY_CHUNK", 37)  # blocks that start mid-window and mid-compressor-span
    blocked = model(PackedBatch.from_sequences([tokens]))
    assert torch.allclose(blocked, whole, rtol=1e-5, atol=1e-5), (blocked - whole).abs().max()
