"""The cached forward: chunked prefill and step-by-step decoding equal one full forward."""

from __future__ import annotations

import math

import pytest
import torch

from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v4 import KVCache, attention_layer_ratios, block_tokens_for
from dsinfer.models.loader import load_model


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint, progress=False)


def _cache(model, slots: int, blocks: int) -> KVCache:
    cfg = model.config
    return KVCache(cfg, attention_layer_ratios(cfg, True), slots, blocks, block_tokens_for(cfg), torch.float32, "cpu")


def _run_in_pieces(model, cache, tokens, piece_lengths, slot, block_table):
    """Feed one sequence piece by piece; return the logits of every position."""
    logits, start = [], 0
    for length in piece_lengths:
        span = SequenceSpan(start, length, slot, block_table)
        batch = PackedBatch(
            torch.tensor(tokens[start : start + length]), torch.arange(start, start + length), [span], cache
        )
        logits.append(model(batch))
        start += length
    return torch.cat(logits)


@pytest.mark.parametrize("pieces", [[90], [1] * 90, [7, 1, 33, 2, 47], [31, 32, 1, 26], [64, 1, 1, 24]])
def test_pieces_equal_one_full_forward(model, pieces):
    tokens = torch.randint(3, 500, (90,), generator=torch.Generator().manual_seed(len(pieces))).tolist()
    full = model(PackedBatch.from_sequences([tokens]))
    cache = _cache(model, slots=3, blocks=12)
    blocks = [7, 2, 9]  # scattered, out of order: positions map through the block table
    got = _run_in_pieces(model, cache, tokens, pieces, slot=1, block_table=blocks)
    assert torch.allclose(got, full, rtol=1e-4, atol=1e-4), (got - full).abs().max()


def test_two_sequences_interleaved_in_one_cache(model):
    """Sequences sharing a cache stay independent: slots and block tables keep them apart."""
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.randint(3, 500, (n,), generator=gen).tolist() for n in (70, 45))
    cache = _cache(model, slots=2, blocks=8)
    tables = {0: [0, 3, 5], 1: [1, 2]}
    outputs = {0: [], 1: []}
    starts = {0: 0, 1: 0}
    for pieces in ([(0, 30), (1, 20)], [(0, 1), (1, 25)], [(0, 39)]):
        spans, ids, positions = [], [], []
        for slot, length in pieces:
            seq = a if slot == 0 else b
            start = starts[slot]
            spans.append(SequenceSpan(start, length, slot, tables[slot]))
            ids += seq[start : start + length]
            positions += range(start, start + length)
            starts[slot] += length
        logits = model(PackedBatch(torch.tensor(ids), torch.tensor(positions), spans, cache))
        offset = 0
        for slot, length in pieces:
            outputs[slot].append(logits[offset : offset + length])
            offset += length
    for slot, seq in ((0, a), (1, b)):
        full = model(PackedBatch.from_sequences([seq]))
        assert torch.allclose(torch.cat(outputs[slot]), full, rtol=1e-4, atol=1e-4)


def test_cache_bytes_are_accounted(model):
    cache = _cache(model, slots=2, blocks=4)
    cfg = model.config
    stored = sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in [layer.window]
        + [
            x
            for comp in (layer.compressor, layer.indexer)
            if comp is not None
            for x in (comp.pending_values, comp.pending_gates, comp.previous_values, comp.previous_gates, comp.entries)
            if x is not None
        ]
    )
    # Four pool blocks and the trash block that absorbs the writes a batched step does not keep.
    assert stored == 2 * cache.layout.slot_bytes() + (4 + 1) * cache.layout.block_bytes()
    per_token = cache.layout.bytes_per_token()
    csa_layers = sum(1 for r in cfg.compress_ratios if r == cfg.csa_ratio)
    assert math.isclose(per_token["csa_kv"], csa_layers * cfg.head_dim / cfg.csa_ratio * 4)
