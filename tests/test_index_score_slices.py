"""Prefill scores the indexer's queries in row slices under a byte budget, and chooses exactly what one slice would.

A chunk's float32 scores [n, W] against every entry of its source grow with chunk x context (16,384 queries x
131,072 ratio-1 entries: 8 GiB), so the index sources (V4.1) and V4's indexer score a bounded number of rows at a
time. A row's scores read no other row: the choices, the candidate blocks and the logits must be bit for bit the
unsliced run's, and no scores call may ask for more than the budget.
"""

from __future__ import annotations

import pytest
import torch

from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v4 import KVCache, attention_layer_ratios, block_tokens_for
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.layers import indexer as indexer_module
from dsinfer.layers.csa2 import IndexerV41
from dsinfer.layers.indexer import Indexer, score_row_slices
from dsinfer.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

UNBOUNDED = 2**62  # one slice per sequence: the unsliced computation
TINY_BUDGET = 1000  # bytes: 2 rows against 90 ratio-1 entries, 5 against 45 ratio-2 entries, 11 against 22 ratio-4


@pytest.fixture(scope="module")
def v41_model(tiny_v41_checkpoint):
    return load_model(tiny_v41_checkpoint, progress=False)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _two_chunks(model, cache, tokens: list[int], table: list[int]) -> list[torch.Tensor]:
    """The logits of ``tokens`` prefilled in two chunks through ``cache`` (slot 1, block table ``table``)."""
    logits, start = [], 0
    for length in (50, len(tokens) - 50):
        span = SequenceSpan(start, length, 1, table)
        positions = torch.arange(start, start + length)
        logits.append(model(PackedBatch(torch.tensor(tokens[start : start + length]), positions, [span], cache)))
        start += length
    return logits


class RecordingOps:
    """An op table that passes every call through and records the [rows, W] of each ``index_scores`` call."""

    def __init__(self, table, shapes: list[tuple[int, int]]) -> None:
        self.table, self.shapes = table, shapes

    def __getattr__(self, op: str):
        fn = getattr(self.table, op)
        if op != "index_scores":
            return fn

        def index_scores(q, keys, head_weights, visible):
            self.shapes.append((q.shape[0], keys.shape[-2]))
            return fn(q, keys, head_weights, visible)

        return index_scores


def _record_scores(monkeypatch, model, scorer_type) -> list[tuple[int, int]]:
    shapes: list[tuple[int, int]] = []
    for module in model.modules():
        if isinstance(module, scorer_type):
            monkeypatch.setattr(module, "ops", RecordingOps(module.ops, shapes))
    return shapes


def _v41_runs(model, monkeypatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits and every index source's prefill choice (and the candidate source's blocks) of a batch of two fresh
    prompts and of a prompt prefilled in two chunks through a cache (the second chunk sees earlier entries)."""
    choices: list[torch.Tensor] = []
    original = IndexerV41.prefill_choice

    def record(self, x, q_latent, positions, keys, inv_freq, state, quantizer):
        indices = original(self, x, q_latent, positions, keys, inv_freq, state, quantizer)
        choices.append(indices.clone())
        if self.is_candidate_source:
            choices.append(state.candidate_blocks.clone())
        return indices

    monkeypatch.setattr(IndexerV41, "prefill_choice", record)
    logits = [model(PackedBatch.from_sequences([_tokens(90, 1), _tokens(37, 2)]))]
    cache = KVCacheV41(model.config, 2, 24, 8, torch.float32, "cpu", with_dspark=True)
    table = [20, 3, 7, 11, 0, 5, 9, 14, 2, 17, 22, 1, 13]
    return logits + _two_chunks(model, cache, _tokens(90, 3), table), choices


def test_row_slices_cover_the_queries_within_the_budget(monkeypatch):
    monkeypatch.setattr(indexer_module, "SCORE_SLICE_BYTES", 4 * 100 * 3)
    assert score_row_slices(10, 100) == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 10)]
    assert score_row_slices(10, 1000) == [slice(i, i + 1) for i in range(10)]  # one row even over the budget
    assert score_row_slices(0, 100) == [slice(0, 0)]
    monkeypatch.setattr(indexer_module, "SCORE_SLICE_BYTES", UNBOUNDED)
    assert score_row_slices(10, 100) == [slice(0, 10)]


def _unsliced_then_sliced(monkeypatch, runs, model, scorer_type=None):
    """``runs(model, patch)`` with one slice a sequence, then in slices of TINY_BUDGET; the second's score shapes
    when ``scorer_type`` is given."""
    with monkeypatch.context() as patch:
        patch.setattr(indexer_module, "SCORE_SLICE_BYTES", UNBOUNDED)
        want = runs(model, patch)
    with monkeypatch.context() as patch:
        patch.setattr(indexer_module, "SCORE_SLICE_BYTES", TINY_BUDGET)
        shapes = None if scorer_type is None else _record_scores(patch, model, scorer_type)
        got = runs(model, patch)
    return want, got, shapes


def test_v41_sliced_prefill_equals_the_unsliced_one(v41_model, monkeypatch):
    (want_logits, want_choices), (got_logits, got_choices), _ = _unsliced_then_sliced(monkeypatch, _v41_runs, v41_model)
    assert len(got_choices) == len(want_choices) > 0
    for got, want in zip(got_choices, want_choices, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(got_logits, want_logits, strict=True):
        assert torch.equal(got, want)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_v41_prefill_scores_stay_within_the_budget(v41_model, monkeypatch):
    monkeypatch.setattr(indexer_module, "SCORE_SLICE_BYTES", TINY_BUDGET)
    shapes = _record_scores(monkeypatch, v41_model, IndexerV41)
    v41_model(PackedBatch.from_sequences([_tokens(90, 4)]))
    cfg = v41_model.config
    ratio_1 = [i for i in range(cfg.num_hidden_layers) if cfg.is_index_source(i) and cfg.compress_ratios[i] == 1]
    assert max(rows * width * 4 for rows, width in shapes) <= TINY_BUDGET
    assert sum(rows for rows, width in shapes if width == 90) == 90 * len(ratio_1) > 0  # every query, in slices
    assert max(width for _, width in shapes) == 90  # the widest source was scored, in slices


@pytest.fixture(scope="module")
def v4_model(tiny_checkpoint):
    return load_model(tiny_checkpoint, progress=False)


def _v4_runs(model, monkeypatch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits and every V4 indexer's prefill choice: two fresh prompts, then one prompt in two cached chunks."""
    choices: list[torch.Tensor] = []
    original = Indexer.forward

    def record(self, *args, **kwargs):
        chosen = original(self, *args, **kwargs)
        choices.append(chosen.clone())
        return chosen

    monkeypatch.setattr(Indexer, "forward", record)
    logits = [model(PackedBatch.from_sequences([_tokens(90, 5), _tokens(41, 6)]))]
    cfg = model.config
    cache = KVCache(cfg, attention_layer_ratios(cfg, True), 2, 12, block_tokens_for(cfg), torch.float32, "cpu")
    return logits + _two_chunks(model, cache, _tokens(90, 7), [7, 2, 9]), choices


def test_v4_sliced_prefill_equals_the_unsliced_one(v4_model, monkeypatch):
    want, got, shapes = _unsliced_then_sliced(monkeypatch, _v4_runs, v4_model, Indexer)
    (want_logits, want_choices), (got_logits, got_choices) = want, got
    assert max(rows * width * 4 for rows, width in shapes) <= TINY_BUDGET
    assert len(shapes) > len(got_choices) > 0  # some chunk was split into several slices
    assert any(choice.shape[1] == v4_model.config.index_topk for choice in want_choices)  # a real top-k
    for got, want in zip(got_choices, want_choices, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(got_logits, want_logits, strict=True):
        assert torch.equal(got, want)
