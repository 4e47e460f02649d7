"""Staged decode-graph inputs equal the whole layout rebuilt from scratch, step after step, as sequences grow,
move between rows, shrink, are rebuilt or leave (padding rows)."""

from __future__ import annotations

import random

import torch

from dsinfer.engine.graph_inputs import StagedGraphInputs
from dsinfer.engine.sequence import new_table_token
from dsinfer.kv.batch import SequenceSpan

WIDTH, TRASH, SPARE = 12, 99, 7


def full_layout(spans: list[SequenceSpan], size: int) -> list[int]:
    """The layout written the plain way: every row and every table entry, every step."""
    padding = size - len(spans)
    tables = [b for s in spans for b in s.block_table + [TRASH] * (WIDTH - len(s.block_table))]
    return ([0] * size + [s.start for s in spans] + [0] * padding + [s.slot for s in spans] + [SPARE] * padding
            + [s.window_from for s in spans] + [0] * padding + tables + [TRASH] * (WIDTH * padding))  # fmt: skip


def test_staged_rows_equal_the_full_layout_through_random_steps():
    rng = random.Random(3)
    size = 6
    staged = StagedGraphInputs((size,), WIDTH, TRASH, SPARE, pinned=False)
    target = torch.empty(size * (4 + WIDTH), dtype=torch.long)
    live = []  # [slot, table, token, start, window_from]
    for step in range(400):
        event = rng.random()
        if event < 0.15 and len(live) < size:
            live.insert(rng.randrange(len(live) + 1), [rng.randrange(6), [rng.randrange(90)], new_table_token(), 0, 0])
        elif event < 0.25 and live:
            live.pop(rng.randrange(len(live)))
        elif event < 0.32 and live:  # a trim: the table shrinks and gets a new token
            seq = rng.choice(live)
            del seq[1][max(1, len(seq[1]) - 2) :]
            seq[2] = new_table_token()
        elif event < 0.36 and live:  # rebuilt (preempted and admitted again)
            seq = rng.choice(live)
            seq[1], seq[2] = [rng.randrange(90)], new_table_token()
        for seq in live:
            seq[3] += 1
            if rng.random() < 0.3 and len(seq[1]) < WIDTH:
                seq[1].append(rng.randrange(90))
        spans = [SequenceSpan(s[3], 1, s[0], list(s[1]), 0, s[4], table_token=s[2]) for s in live]
        staged.write(target, spans, size)
        assert target.tolist() == full_layout(spans, size), f"step {step}"


def test_a_span_without_a_token_is_always_restaged():
    staged = StagedGraphInputs((2,), WIDTH, TRASH, SPARE, pinned=False)
    target = torch.empty(2 * (4 + WIDTH), dtype=torch.long)
    for table in ([1, 2, 3], [4, 5], [6]):  # same row, no token: each step's table must show
        spans = [SequenceSpan(0, 1, 0, table)]
        staged.write(target, spans, 2)
        assert target.tolist() == full_layout(spans, 2)
