"""The fixed-width rollback (device tensors alone, what the speculative CUDA graphs run) leaves every cache tensor
of every real sequence exactly as the host-indexed rollback does, for every accepted count.

A steady engine's bucket (three sequences and a padding row) runs its verify forward twice from the same cache:
once rolled back by :class:`~dsinfer.speculative.fixed_rollback.FixedWidthRollback` from device accepted counts,
once by :class:`~dsinfer.speculative.rollback.CacheRollback` from the host's snapshot and keeps. Window rings,
unfinished and last complete compressor windows, compressed entries (index keys, scales) of every block but the
trash block, and V4.1's Engram look-back must match byte for byte.
"""

from __future__ import annotations

import pytest
import torch
from engine_harness import random_prompts

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.speculative.rollback import PaddedJournal
from dsinfer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _state_tensors(rollback) -> list[torch.Tensor]:
    """Every tensor a verify step writes and the rollbacks restore."""
    tensors = list(rollback.rings)
    for compressor in rollback.compressors:
        tensors += list(compressor.pending or ()) + list(compressor.previous or ()) + list(compressor.entries)
    if rollback.engram_history is not None:
        tensors.append(rollback.engram_history)
    return tensors


def _owned(tensors: list[torch.Tensor], rollback, slots: list[int], trash: int) -> list[torch.Tensor]:
    """The parts of ``tensors`` the real sequences own: their slots' rows, every block but the trash block."""
    entries = {id(t) for compressor in rollback.compressors for t in compressor.entries}
    parts = []
    for tensor in tensors:
        if id(tensor) in entries:
            keep = [block for block in range(tensor.shape[0]) if block != trash]
            parts.append(tensor[keep].view(torch.uint8) if tensor.element_size() == 1 else tensor[keep])
        else:
            parts.append(tensor[slots].view(torch.uint8) if tensor.element_size() == 1 else tensor[slots])
    return [part.clone() for part in parts]


def _steady(model, tokenizer, spec: dict, **options):
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160, cuda_graph_sizes=(4,),
                          speculative_config=spec, **options)  # fmt: skip
    engine = LLMEngine(model, tokenizer, config)
    graphs = engine.worker.speculative.graphs
    runs, prepare = [], graphs.prepare

    def recording(step):
        runs.append(prepare(step))
        return runs[-1]

    graphs.prepare = recording
    for prompt in random_prompts(3, seed=3, low=13, high=31):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    while len(runs) < 3:
        engine.step()
    return engine, runs[-1]


def _check_fixed_rollback_matches_host_rollback(engine, run) -> None:
    executor = engine.worker.speculative
    graphs, rollback = executor.graphs, executor.rollback
    cache, count = graphs.cache, len(run.spans)
    slots, trash = [span.slot for span in run.spans], cache.trash_block
    tensors = _state_tensors(rollback)
    width = graphs.width
    with torch.inference_mode():
        before = [t.clone() for t in tensors]
        for accepted in ([0, 1, width - 1], [width - 1, 0, 2], [1, width - 1, 0]):
            for tensor, value in zip(tensors, before, strict=True):
                tensor.copy_(value)
            token_ids = graphs.inputs[:count, :width].reshape(-1)
            host_snapshot = rollback.snapshot_spans(run.spans, token_ids if rollback.engram_history is not None
                                                    else None)  # fmt: skip
            graphs._verify_forward(run.size)
            after_forward = [t.clone() for t in tensors]
            graphs.result[:count, 0] = torch.tensor(accepted)
            graphs._draft_forward(run.size)  # the fixed-width rollback, then the drafts
            fixed = _owned(tensors, rollback, slots, trash)
            for tensor, value in zip(tensors, after_forward, strict=True):
                tensor.copy_(value)
            journal = PaddedJournal(graphs.records).first(count)
            rollback.rollback_spans(host_snapshot, journal, [a + 1 for a in accepted])
            host = _owned(tensors, rollback, slots, trash)
            changed = _owned(after_forward, rollback, slots, trash)
            assert any(not torch.equal(a, b) for a, b in zip(host, changed, strict=True))  # something rolled back
            for index, (got, want) in enumerate(zip(fixed, host, strict=True)):
                assert torch.equal(got, want), f"cache tensor {index} differs after accepting {accepted}"


@pytest.mark.parametrize("k", [3, 5])
def test_v4_fixed_width_rollback_equals_the_host_rollback(tiny_v4_model, tiny_v4_tokenizer, k):
    engine, run = _steady(tiny_v4_model, tiny_v4_tokenizer, {"method": "mtp", "num_speculative_tokens": k})
    _check_fixed_rollback_matches_host_rollback(engine, run)


def test_v41_fixed_width_rollback_equals_the_host_rollback(tiny_v41_checkpoint):
    """Quantized storage (FP8 / FP4 codes and scales), every CSA2 source, the Engram look-back."""
    model = load_model(tiny_v41_checkpoint, progress=False)
    tokenizer = Tokenizer.from_dir(tiny_v41_checkpoint)
    engine, run = _steady(model, tokenizer, {"method": "dspark", "num_speculative_tokens": 3},
                          num_cache_blocks=64, block_tokens=8)  # fmt: skip
    assert engine.runner.cache.quantized_storage and engine.worker.speculative.rollback.engram_history is not None
    _check_fixed_rollback_matches_host_rollback(engine, run)
