"""V4.1's prefill chooses each query's entries as a decode step of that position does: the ``index_topk``
best entries with a finite score among those the candidate source allows, in ascending order, then -1.

Checked against a selection written out here entry by entry (sort by score, lowest entry first among equals),
for every selection a prefill makes: fresh prompts, a prompt whose second chunk reads the first's entries, the
candidate source (no limit) and the later index sources (limited to the candidate blocks).
"""

from __future__ import annotations

import math

import pytest
import torch

from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.layers.csa2 import IndexerV41
from dsinfer.models.loader import load_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _written_out(scores: torch.Tensor, k: int, allowed: torch.Tensor | None) -> torch.Tensor:
    """Each row's best ``min(k, W)`` allowed finite entries, ascending, -1 after them."""
    rows, width = scores.shape
    out = torch.full((rows, min(k, width)), -1, dtype=torch.long)
    for row in range(rows):
        values = scores[row].tolist()
        ok = [j for j in range(width) if math.isfinite(values[j]) and (allowed is None or bool(allowed[row, j]))]
        best = sorted(sorted(ok, key=lambda j: (-values[j], j))[: min(k, width)])
        out[row, : len(best)] = torch.tensor(best, dtype=torch.long)
    return out


class RecordingSelections:
    """An op table that passes every call through and keeps each ``index_topk_decode`` call and its result."""

    def __init__(self, table, calls: list) -> None:
        self.table, self.calls = table, calls

    def __getattr__(self, op: str):
        fn = getattr(self.table, op)
        if op != "index_topk_decode":
            return fn

        def select(scores, k, allowed=None):
            chosen = fn(scores, k, allowed)
            self.calls.append((scores.clone(), k, None if allowed is None else allowed.clone(), chosen.clone()))
            return chosen

        return select


def test_every_prefill_selection_is_the_written_out_one(tiny_v41_checkpoint, monkeypatch):
    model = load_model(tiny_v41_checkpoint, progress=False)
    calls: list = []
    for module in model.modules():
        if isinstance(module, IndexerV41):
            monkeypatch.setattr(module, "ops", RecordingSelections(module.ops, calls))
    tokens = torch.randint(3, 500, (150,), generator=torch.Generator().manual_seed(11))
    model(PackedBatch.from_sequences([tokens[:90].tolist(), tokens[90:127].tolist()]))
    cache = KVCacheV41(model.config, 2, 32, 8, torch.float32, "cpu", with_dspark=True)
    table, start = [20, 3, 7, 11, 0, 5, 9, 14, 2, 17, 22, 1, 13, 25, 30, 4, 8, 6, 10], 0
    for length in (60, 90):  # the second chunk's queries read the first chunk's entries through the cache
        span = SequenceSpan(start, length, 1, table)
        model(PackedBatch(tokens[start : start + length], torch.arange(start, start + length), [span], cache))
        start += length
    assert calls
    assert any(allowed is not None for _, _, allowed, _ in calls)  # a source limited to the candidate blocks
    assert any(allowed is None for _, _, allowed, _ in calls)  # the candidate source
    real = 0
    for scores, k, allowed, chosen in calls:
        want = _written_out(scores, k, allowed)
        assert torch.equal(chosen, want)
        finite = torch.isfinite(scores) if allowed is None else torch.isfinite(scores) & allowed
        real += int((finite.sum(-1) > k).sum())
    assert real > 0  # rows with more candidates than the top-k keeps
