"""The V4 forward reads no device value on the host: every op that would make the host wait is refused.

On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` proves it (``benchmarks/fast_path_checks.py``). Here a
dispatch mode refuses the aten ops that need a device value on the host (``item``, ``nonzero``, boolean-mask
indexing, data-dependent repeats and uniques) while a V4 decode step runs. The routed experts run through a
sync-free stand-in (each slot's expert weights gathered), because the op's CPU reference is allowed to loop over
experts; the Triton backend's own sync-freedom is checked on the GPU, where it is captured in a CUDA graph.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dsinfer.layers.moe import MoE
from dsinfer.models.tiny import build_random_model, tiny_config
from dsinfer.ops.moe import ExpertWeights

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fast_path_checks  # noqa: E402

aten = torch.ops.aten
HOST_READS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten.is_nonzero.default,
    aten.repeat_interleave.Tensor,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.bincount.default,
}

# A tensor made from Python data inside a step is copied from pageable host memory on a GPU: the copy
# synchronises and a CUDA graph capture refuses it (``torch.tensor(values, device=...)``, ``x[[0, 2]]``). A 0-dim
# value (``x[i] = 1.0``) travels as a kernel argument instead, so only tensors with dimensions count.
HOST_DATA = {aten.lift_fresh.default, aten.lift_fresh_copy.default}

# Boolean-mask reads and writes (``x[mask]``, ``x[mask] = v``) count the mask's True entries on the host.
MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class RefuseHostReads(TorchDispatchMode):
    """Refuses host reads; with ``host_data`` also tensors made from host data (what a graph-captured decode step
    must not do; a prefill step may copy its host-built metadata through pinned memory)."""

    def __init__(self, host_data: bool = False) -> None:
        super().__init__()
        self.host_data = host_data

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise AssertionError(f"{func} reads a device value on the host")
        if self.host_data and func in HOST_DATA and args[0].dim() > 0:
            raise AssertionError(f"{func} copies host data to the device inside the step")
        if func in MASK_INDEXED and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else [])
        ):
            raise AssertionError("boolean-mask indexing reads how many entries survive on the host")
        return func(*args, **kwargs)


def _gathered_moe(x, weights: ExpertWeights, expert_ids, expert_weights, swiglu_limit):
    inter = weights.intermediate_size
    w13, w2 = weights.w13[expert_ids], weights.w2[expert_ids]  # [T, k, 2I, H], [T, k, H, I]
    hidden = torch.einsum("th,tkoh->tko", x, w13.to(x.dtype))
    gate = hidden[..., :inter].clamp(max=swiglu_limit)
    up = hidden[..., inter:].clamp(min=-swiglu_limit, max=swiglu_limit)
    out = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, w2.to(x.dtype))
    return (out * expert_weights[..., None].to(x.dtype)).sum(dim=1)


def _use_gathered_moe(model) -> None:
    stand_in = type("GatheredMoE", (), {"routed_moe": staticmethod(_gathered_moe)})()
    for module in model.modules():
        if isinstance(module, MoE):
            module.ops = stand_in


@pytest.mark.parametrize("sequences", [1, 3])
def test_a_v4_decode_step_reads_nothing_on_the_host(sequences):
    from dataclasses import replace

    config = replace(tiny_config(), num_nextn_predict_layers=0)
    model = build_random_model(config, torch.float32, "cpu", seed=1)
    cache = fast_path_checks.fresh_cache(config, sequences, 40, "cpu")
    batch = fast_path_checks.prefill_and_decode_batch(model, cache, sequences, 40, "cpu")
    expected = model(batch)
    _use_gathered_moe(model)
    assert batch.is_decode
    with RefuseHostReads(host_data=True):
        got = model(batch)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_the_check_would_catch_a_host_read():
    with pytest.raises(AssertionError, match="reads"), RefuseHostReads():
        torch.ones(3).nonzero()
    mask = torch.tensor([True, False, True])
    with pytest.raises(AssertionError, match="boolean-mask"), RefuseHostReads():
        torch.zeros(3)[mask] = 1.0
    with pytest.raises(AssertionError, match="host data"), RefuseHostReads(host_data=True):
        torch.arange(3)[[0, 2]]


def test_a_v4_prefill_chunk_reads_nothing_on_the_host():
    """Prefill takes the per-sequence path, still without host reads (host-known lengths decide the shapes)."""
    from dataclasses import replace

    from dsinfer.kv.batch import PackedBatch, SequenceSpan

    config = replace(tiny_config(), num_nextn_predict_layers=0)
    model = build_random_model(config, torch.float32, "cpu", seed=2)
    _use_gathered_moe(model)
    cache = fast_path_checks.fresh_cache(config, 2, 90, "cpu")
    first = PackedBatch(torch.arange(3, 40), torch.arange(37), [SequenceSpan(0, 37, 0, [0, 1, 2])], cache)
    model(first)
    spans = [SequenceSpan(37, 29, 0, [0, 1, 2]), SequenceSpan(0, 50, 1, [3, 4, 5])]
    ids = torch.arange(100, 179)
    positions = torch.cat([torch.arange(37, 66), torch.arange(50)])
    chunk = PackedBatch(ids, positions, spans, cache)
    _ = chunk.device_spans
    with RefuseHostReads():
        logits = model(chunk)
    assert torch.isfinite(logits).all()


def _dense_experts(model) -> None:
    """Routed experts as dense stacks (what the gathered stand-in indexes), dequantised exactly from FP4."""
    from dsinfer.ops.moe import dequantize_expert

    for module in model.modules():
        if isinstance(module, MoE):
            weights = module.routed_weights()
            pairs = [dequantize_expert(weights, e, torch.float32) for e in range(weights.num_experts)]
            w13, w2 = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
            module.pack(ExpertWeights(w13, None, w2, None, weights.intermediate_size, False))


@pytest.mark.parametrize("quantized_storage", [False, True])
def test_a_v41_decode_step_reads_nothing_on_the_host(tiny_v41_checkpoint, quantized_storage):
    """Every V4.1 layer role (window-only, ratio-2 and ratio-1 KV sources, candidate and keyless index sources,
    reusers) and Engram decode one token per sequence from the step's device metadata."""
    import copy

    from dsinfer.kv.batch import PackedBatch, SequenceSpan
    from dsinfer.kv.cache_v41 import KVCacheV41
    from dsinfer.models.loader import load_model

    model = load_model(tiny_v41_checkpoint, progress=False)
    _dense_experts(model)
    _use_gathered_moe(model)
    cache = KVCacheV41(model.config, 3, 24, 8, torch.float32, "cpu", quantized_storage=quantized_storage)
    lengths, tables = [37, 6, 1], [[5, 1, 9, 12, 20], [0, 2], [3]]
    for slot, (length, table) in enumerate(zip(lengths, tables, strict=True)):
        prompt = torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(slot))
        model(PackedBatch(prompt, torch.arange(length), [SequenceSpan(0, length, slot, table)], cache))
    spans = [SequenceSpan(n, 1, slot, tables[slot]) for slot, n in enumerate(lengths)]
    batch = PackedBatch(torch.tensor([7, 8, 9]), torch.tensor(lengths), spans, copy.deepcopy(cache))
    expected = model(batch)
    batch = PackedBatch(torch.tensor([7, 8, 9]), torch.tensor(lengths), spans, cache)
    _ = batch.device_spans
    assert batch.is_decode
    with RefuseHostReads(host_data=True):
        got = model(batch)
    assert torch.equal(got, expected)


class RecordOps(TorchDispatchMode):
    """The aten ops a forward runs, with their output shapes: what a CUDA graph capture fixes."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else [out]
        self.ops.append((str(func), tuple(tuple(o.shape) for o in outputs if isinstance(o, torch.Tensor))))
        return out


def test_v41_decode_steps_run_the_same_ops_whichever_windows_complete(tiny_v41_checkpoint):
    """Two decode steps of the same sequences, one where some tokens complete a ratio-2 window and one where the
    others do: the same ops on the same shapes (the unfinished entries go to the trash block), so one captured
    graph replays both."""
    from dsinfer.kv.batch import PackedBatch, SequenceSpan
    from dsinfer.kv.cache_v41 import KVCacheV41
    from dsinfer.models.loader import load_model

    model = load_model(tiny_v41_checkpoint, progress=False)
    _dense_experts(model)
    _use_gathered_moe(model)
    cache = KVCacheV41(model.config, 3, 24, 8, torch.float32, "cpu")
    lengths, tables = [37, 6, 1], [[5, 1, 9, 12, 20], [0, 2], [3]]
    for slot, (length, table) in enumerate(zip(lengths, tables, strict=True)):
        prompt = torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(slot))
        model(PackedBatch(prompt, torch.arange(length), [SequenceSpan(0, length, slot, table)], cache))
    recorded = []
    for step in range(2):
        positions = [n + step for n in lengths]
        spans = [SequenceSpan(p, 1, slot, tables[slot]) for slot, p in enumerate(positions)]
        batch = PackedBatch(torch.tensor([7, 8, 9]), torch.tensor(positions), spans, cache)
        _ = batch.device_spans
        with RecordOps() as record:
            model(batch)
        recorded.append(record.ops)
    completing = [[(p + step + 1) % 2 == 0 for p in lengths] for step in range(2)]
    assert completing == [[True, False, True], [False, True, False]]
    assert len(recorded[0]) == len(recorded[1])
    assert recorded[0] == recorded[1]


@pytest.mark.parametrize("quantized_storage", [False, True])
def test_a_v41_prefill_step_reads_nothing_on_the_host(tiny_v41_checkpoint, quantized_storage):
    """A mixed V4.1 step (a prompt's next chunk, whole prompts of different lengths, a decode token) runs every
    layer role and Engram from host-known lengths only; its logits and cache are those of an unchecked run."""
    import copy

    from dsinfer.kv.batch import PackedBatch, SequenceSpan
    from dsinfer.kv.cache_v41 import KVCacheV41
    from dsinfer.models.loader import load_model

    model = load_model(tiny_v41_checkpoint, progress=False)
    _dense_experts(model)
    _use_gathered_moe(model)
    cache = KVCacheV41(model.config, 4, 24, 8, torch.float32, "cpu", quantized_storage=quantized_storage)
    tables = [[5, 1, 9, 12, 20, 2, 7, 8, 10], [0, 3, 4, 6, 11, 13, 14], [15], [16]]
    generator = torch.Generator().manual_seed(3)
    earlier = {0: 37, 3: 6}  # slot 0 continues its prompt, slot 3 decodes after its prompt
    for slot, length in earlier.items():
        prompt = torch.randint(3, 500, (length,), generator=generator)
        model(PackedBatch(prompt, torch.arange(length), [SequenceSpan(0, length, slot, tables[slot])], cache))
    spans = [
        SequenceSpan(37, 29, 0, tables[0]),
        SequenceSpan(0, 50, 1, tables[1]),
        SequenceSpan(0, 3, 2, tables[2]),
        SequenceSpan(6, 1, 3, tables[3]),
    ]
    ids = torch.randint(3, 500, (sum(span.length for span in spans),), generator=generator)
    positions = torch.cat([torch.arange(span.start, span.start + span.length) for span in spans])
    reference_cache = copy.deepcopy(cache)
    expected = model(PackedBatch(ids, positions, spans, reference_cache))
    batch = PackedBatch(ids, positions, spans, cache)
    assert not batch.is_decode
    with RefuseHostReads():
        got = model(batch)
    assert torch.equal(got, expected)
    assert torch.equal(cache.engram_history, reference_cache.engram_history)
    for layer, reference in zip(cache.layers, reference_cache.layers, strict=True):
        assert torch.equal(layer.window, reference.window)
        if layer.source is not None:
            assert torch.equal(layer.source.entries, reference.source.entries)
            assert torch.equal(layer.source.index_keys, reference.source.index_keys)


def test_a_v41_bounded_prefill_reads_nothing_on_the_host(tiny_v41_checkpoint):
    """CED prefill (encoder over the prompts, the first decoder layer's compressor, a bounded decoder replay)."""
    from dsinfer.kv.batch import PackedBatch
    from dsinfer.models.loader import load_model

    model = load_model(tiny_v41_checkpoint, progress=False)
    _dense_experts(model)
    _use_gathered_moe(model)
    assert model.config.decoder_start is not None
    prompts = [list(range(3, 203)), list(range(10, 60))]
    replay = model.config.sliding_window
    expected = model.prefill(PackedBatch.from_sequences(prompts), mode="bounded", replay_tokens=replay)
    batch = PackedBatch.from_sequences(prompts)
    batch.attach_scratch_cache(model.scratch_cache(batch.seq_lens, batch.input_ids.device, False))
    with RefuseHostReads():
        got = model.prefill(batch, mode="bounded", replay_tokens=replay)
    assert torch.equal(got, expected)
