"""The V4 layer's prefill with the Triton ``sparse_attention_prefill`` (in Triton's CPU interpreter) equals it with
the reference: whole prompts, then a mixed step of chunks starting mid-sequence (one after a prefix hit, with a
late ``window_from``) and a one-token span. The reference reads the sequence bounds from the host, the kernel
from the step's device tensors, so this binds the layer's tensor arguments to the bounds the reference uses."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v4 import KVCache, attention_layer_ratios, block_tokens_for
from dsinfer.models.tiny import build_random_model, tiny_config
from dsinfer.ops import registry

LENGTHS = (45, 23, 70)  # the final lengths of the three sequences
STEPS = (
    ((0, 0, 30, 0), (1, 0, 9, 0), (2, 0, 40, 0)),  # (slot, start, new tokens, window_from): whole prompt chunks
    ((0, 30, 15, 0), (1, 9, 1, 0), (2, 40, 30, 33)),  # mid-sequence chunks, a one-token span, a prefix hit's ring
)


def _table(model, backend: str) -> registry.OpTable:
    table = registry.reference_table("cpu", torch.float32)
    chosen = {b.name: b for b in registry.backends("sparse_attention_prefill")}
    table.chosen["sparse_attention_prefill"] = chosen[backend]
    return table


def _run_steps(model, table: registry.OpTable) -> list[torch.Tensor]:
    registry.bind_ops(model, table)
    config = model.config
    block_tokens = block_tokens_for(config)
    need = [math.ceil(n / block_tokens) for n in LENGTHS]
    cache = KVCache(config, attention_layer_ratios(config, False), 3, sum(need) + 2, block_tokens, torch.float32,
                    "cpu")  # fmt: skip
    order = torch.randperm(sum(need) + 1, generator=torch.Generator().manual_seed(4)).tolist()
    tables = [order[sum(need[:s]) : sum(need[: s + 1])] for s in range(3)]
    tokens = torch.randint(3, 500, (3, max(LENGTHS)), generator=torch.Generator().manual_seed(5))
    logits = []
    for step in STEPS:
        spans, ids, positions = [], [], []
        for slot, start, length, window_from in step:
            spans.append(SequenceSpan(start, length, slot, tables[slot], window_from=window_from))
            ids += tokens[slot, start : start + length].tolist()
            positions += range(start, start + length)
        logits.append(model(PackedBatch(torch.tensor(ids), torch.tensor(positions), spans, cache)))
    return logits


def run_interpreted_cases() -> list[str]:
    """TRITON_INTERPRET=1 must be set before Triton loads."""
    model = build_random_model(tiny_config(), torch.float32, "cpu", seed=3)
    expected = _run_steps(copy.deepcopy(model), _table(model, "reference"))
    got = _run_steps(model, _table(model, "triton"))
    failures = []
    for index, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        error = (mine - theirs).abs().max().item()
        if not error <= 1e-4:
            failures.append(f"step {index}: max |triton - reference| logits = {error:.3g}")
    return failures


def test_layer_prefill_with_triton_equals_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_sparse_attention_prefill_layer")
