"""KVCacheV41.attend_verify (every row of a verify step in one decode op, the step's rows read beside the ring)
against the column-by-column decode path it replaced: the same outputs and the same ring afterwards, in model-dtype
and coded storage, with one sequence's window wrapping and another's starting after a prefix hit, attending the
chosen entries of a KV source (and none: a window-only layer)."""

from __future__ import annotations

import pytest
import torch

from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.kv.fixed_width import FixedWidthBatch
from dsinfer.models.tiny import tiny_config_v41
from dsinfer.ops.registry import resolve

LAYER, SOURCE = 2, 1  # a ratio-2 layer and the KV source whose entries it reads
STARTS, SLOTS, WINDOW_FROM, WIDTH = (21, 5), (0, 2), (0, 3), 4


def _cache(quantized: bool) -> tuple[KVCacheV41, torch.Tensor]:
    """A cache whose rings hold every position before each sequence's start and whose source holds every entry
    the step's positions see; and the sequences' block tables."""
    config = tiny_config_v41()
    cache = KVCacheV41(config, 4, 16, 8, torch.float32, "cpu", quantized_storage=quantized)
    gen = torch.Generator().manual_seed(0)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    for start, slot, table in zip(STARTS, SLOTS, tables, strict=True):
        positions = torch.arange(start)
        cache.write_window(LAYER, slot, positions, torch.randn(start, config.head_dim, generator=gen))
        entry_ids = torch.arange((start + WIDTH) // 2)
        entries = torch.randn(len(entry_ids), config.head_dim, generator=gen)
        keys = torch.randn(len(entry_ids), config.index_head_dim, generator=gen)
        cache.write_entries(SOURCE, table, entry_ids, entries, keys)
    return cache, tables


def _step(cache: KVCacheV41, tables: torch.Tensor) -> tuple[FixedWidthBatch, dict]:
    """The verify batch and its rows in the packed order: queries, window rows, chosen entries (-1: none)."""
    config, size = cache.config, len(STARTS)
    batch = FixedWidthBatch(torch.zeros(size, WIDTH, dtype=torch.long), torch.tensor(STARTS), torch.tensor(SLOTS),
                            torch.tensor(WINDOW_FROM), tables, cache, spare_slot=3)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    rows = size * WIDTH
    visible = (batch.positions.flatten() + 1) // 2  # entries each row's position sees at ratio 2
    picks = torch.randint(0, 64, (rows, 6), generator=gen)
    indices = torch.where(picks < visible[:, None], picks, -1)
    return batch, {
        "q": torch.randn(rows, config.num_attention_heads, config.head_dim, generator=gen),
        "kv": torch.randn(rows, config.head_dim, generator=gen),
        "indices": indices,
        "sink": torch.randn(config.num_attention_heads, generator=gen),
    }


@pytest.mark.parametrize("quantized", [False, True], ids=["model-dtype", "coded"])
@pytest.mark.parametrize("with_entries", [True, False], ids=["entries", "window-only"])
def test_one_pass_verify_attention_is_the_column_by_column_decode(quantized, with_entries):
    ops = resolve("cpu", torch.float32)
    scale = tiny_config_v41().head_dim ** -0.5
    one_pass, tables = _cache(quantized)
    columns, _ = _cache(quantized)
    batch, step = _step(one_pass, tables)
    chosen = (step["indices"], SOURCE) if with_entries else (None, None)
    got = one_pass.attend_verify(ops, LAYER, chosen, step["q"], batch, step["kv"], step["sink"], scale)

    column_batch, _ = _step(columns, tables)
    size, want = len(STARTS), torch.empty_like(got)
    for j in range(WIDTH):
        rows = torch.arange(size) * WIDTH + j  # column j: position start + j of every sequence
        column = column_batch.column(j)
        columns.write_window(LAYER, column.device_spans.slots, column.positions, step["kv"][rows])
        indices = step["indices"][rows] if with_entries else None
        entries_layer = SOURCE if with_entries else None
        want[rows] = columns.attend_decode(ops, LAYER, entries_layer, step["q"][rows], column, indices, step["sink"],
                                           scale)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for mine, theirs in zip(one_pass.slot_tensors(), columns.slot_tensors(), strict=True):
        if mine is not None:
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
