"""Every V4.1 layer's prefill call of ``sparse_attention_prefill``, made through the Triton kernel (in Triton's CPU
interpreter, no fallback) on the arguments the layer built, equals the reference on them, in both cache storages:
whole prompt chunks, then a mixed step of chunks starting mid-sequence (one after a prefix hit, with a late
``window_from``) and a one-token span. Every layer role runs (window only, ratio-2 and ratio-1 KV sources and
their reusers, the candidate source, a keyless index source). The reference reads the sequence bounds from the
host, the kernel from the step's device tensors; with coded storage the op reads decoded rings through slots of
their own and decoded entries through tables of their own: this binds the glue's views and tensors to the bounds.

Each call is compared where it is made (the model goes on with the reference's output): the trained-in FP8 / FP4
rounding of the next layers' KV would turn rounding-level differences into whole grid steps downstream."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from interpreted import assert_interpreted_cases_pass

from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.models.deepseek_v41 import DeepseekV41
from dsinfer.models.tiny import randomize_v41_, tiny_config_v41
from dsinfer.ops import registry
from dsinfer.ops.sparse_attention.prefill_reference import SparsePrefillInputs, sparse_attention_prefill_reference
from dsinfer.ops.sparse_attention.prefill_triton import sparse_attention_prefill_launch

BLOCK_TOKENS = 8
LENGTHS = (45, 23, 70)  # the final lengths of the three sequences
SLOTS = (2, 3, 0)  # each sequence's state slot (not its row in the batch: the coded rings' view renumbers them)
STEPS = (
    ((0, 0, 30, 0), (1, 0, 9, 0), (2, 0, 40, 0)),  # (sequence, start, new tokens, window_from): whole prompt chunks
    ((0, 30, 15, 0), (1, 9, 1, 0), (2, 40, 30, 33)),  # mid-sequence chunks, a one-token span, a prefix hit's ring
)
# The interpreter runs a program per token of every layer's call (about 15 ms each), so its steps are shorter, with
# the same features: chunks past the 16-token window, starts mid-block, at an odd position (mid ratio-2 window) and
# on a block boundary, rings wrapped, more compressed entries than the indexer's top-k and the candidate blocks, a
# window_from 7 positions before its chunk, an odd final length. CUDA runs LENGTHS and STEPS.
INTERPRETED_LENGTHS = (27, 23, 44)
INTERPRETED_STEPS = (
    ((0, 0, 20, 0), (1, 0, 9, 0), (2, 0, 24, 0)),
    ((0, 20, 7, 0), (1, 9, 1, 0), (2, 24, 20, 17)),
)


def _checking_table(record: list, device: str) -> registry.OpTable:
    """The reference table, with a prefill op that also launches the kernel and records how far it is."""
    table = registry.reference_table(device, torch.float32)

    def checked(inputs: SparsePrefillInputs):
        want = sparse_attention_prefill_reference(inputs)
        got = sparse_attention_prefill_launch(inputs)
        entries, indices = inputs.entries, inputs.indices
        error = float((got - want).abs().max() / want.abs().max())
        record.append((entries is not None and indices is not None and indices.shape[1] > 0, error))
        return want

    backend = table.chosen["sparse_attention_prefill"]
    table.chosen["sparse_attention_prefill"] = dataclasses.replace(backend, name="checked", fn=checked)
    return table


def _run_steps(model: DeepseekV41, table: registry.OpTable, quantized: bool, device: str, lengths, steps) -> None:
    registry.bind_ops(model, table)
    need = [math.ceil(n / BLOCK_TOKENS) for n in lengths]
    cache = KVCacheV41(model.config, 4, sum(need) + 2, BLOCK_TOKENS, torch.float32, device,
                       quantized_storage=quantized)  # fmt: skip
    order = torch.randperm(sum(need) + 1, generator=torch.Generator().manual_seed(4)).tolist()
    tables = [order[sum(need[:s]) : sum(need[: s + 1])] for s in range(3)]
    tokens = torch.randint(3, 500, (3, max(lengths)), generator=torch.Generator().manual_seed(5))
    for step in steps:
        spans, ids, positions = [], [], []
        for sequence, start, length, window_from in step:
            spans.append(SequenceSpan(start, length, SLOTS[sequence], tables[sequence], window_from=window_from))
            ids += tokens[sequence, start : start + length].tolist()
            positions += range(start, start + length)
        model(PackedBatch(torch.tensor(ids, device=device), torch.tensor(positions, device=device), spans, cache))


def check_layers(device: str, lengths=LENGTHS, steps=STEPS) -> list[str]:
    """Failure messages: calls that were not made as expected, or whose kernel result is off the reference."""
    config = tiny_config_v41(engram_layer_ids=(), engram_num_embeddings=())
    model = randomize_v41_(DeepseekV41(config, with_mtp=False), seed=3).to(device)
    layers, compressed = config.num_hidden_layers, sum(1 for ratio in config.compress_ratios if ratio)
    failures = []
    for quantized in (False, True):
        record = []
        with torch.inference_mode():
            _run_steps(model, _checking_table(record, device), quantized, device, lengths, steps)
        with_entries = sum(chosen for chosen, _ in record)
        if len(record) != layers * len(steps) or with_entries != compressed * len(steps):
            failures.append(f"quantized={quantized}: {len(record)} calls, {with_entries} with chosen entries")
        for call, (_, error) in enumerate(record):
            if not error <= 1e-5:
                failures.append(f"quantized={quantized} step {call // layers} layer {call % layers}: {error:.3g}")
    return failures


def run_interpreted_cases() -> list[str]:
    """TRITON_INTERPRET=1 must be set before Triton loads."""
    return check_layers("cpu", INTERPRETED_LENGTHS, INTERPRETED_STEPS)


def test_v41_layer_prefill_with_triton_equals_reference_in_the_interpreter():
    pytest.importorskip("triton")
    assert_interpreted_cases_pass("test_sparse_attention_prefill_layer_v41")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_v41_layer_prefill_with_triton_equals_reference_on_cuda():
    pytest.importorskip("triton")
    assert check_layers("cuda") == []
