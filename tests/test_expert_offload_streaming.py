"""Routed experts read once from the checkpoint straight into their device slot or host row (the engine's load
with ``--expert-offload``) give the all-resident tokens, and never hold more than the offloaded experts plus one
expert in host memory while loading."""

from __future__ import annotations

import weakref
from collections import Counter

import pytest
import torch
from engine_harness import random_prompts, run_all

from dsinfer.config import ConfigError, EngineConfig
from dsinfer.config.expert_split import FETCH_BUFFERS
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.offload import install_expert_offload, streaming
from dsinfer.parallel.engine_loop import load_engine_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 48, "max_model_len": 160, "num_cache_blocks": 14}


def _tokens(model, checkpoint) -> list[list[int]]:
    engine = LLMEngine(model, Tokenizer.from_dir(checkpoint), EngineConfig(**ENGINE))
    return [out.outputs[0].token_ids for out in run_all(engine, random_prompts(12, seed=3), GREEDY)]


def _expert_bytes(model) -> int:
    weights = model.layers[0].ffn.routed_weights()
    return weights.nbytes // weights.num_experts


def test_engine_load_streams_the_experts_and_gives_the_all_resident_tokens(tiny_checkpoint):
    """``--expert-offload`` with a GiB budget: the engine's load defers the experts, sizes the resident count,
    reads each expert into its slot or host row, and serves the all-resident tokens."""
    expected = _tokens(load_model(tiny_checkpoint, progress=False), tiny_checkpoint)
    shapes = load_model(tiny_checkpoint, progress=False, expert_device="meta")
    layers, experts, expert = 4, 8, _expert_bytes(shapes)
    budget = (layers * 3 + FETCH_BUFFERS * (experts - 3)) * expert / 2**30  # 3 resident per layer
    model = load_engine_model(tiny_checkpoint, EngineConfig(**ENGINE, expert_offload=budget))
    offload = model.expert_offload
    assert not hasattr(model, "deferred_experts")  # every expert was read and the shards let go
    assert [len(layer.resident) for layer in offload.layers] == [3] * layers
    assert all(layer.host.weights.num_experts == experts - 3 for layer in offload.layers)  # offloaded only
    assert _tokens(model, tiny_checkpoint) == expected
    assert offload.arena.fetched_experts > 0


@pytest.mark.parametrize("resident", [0, 5])
def test_v41_streamed_experts_give_the_all_resident_tokens(tiny_v41_checkpoint, resident):
    expected = _tokens(load_model(tiny_v41_checkpoint, progress=False), tiny_v41_checkpoint)
    model = load_model(tiny_v41_checkpoint, progress=False, expert_device="meta")
    offload = install_expert_offload(model, resident, rebalance_every=2)
    assert _tokens(model, tiny_v41_checkpoint) == expected
    assert offload.arena.fetched_experts > 0 and offload.steps >= 4  # misses fetched; re-balances (swaps) ran


def test_every_expert_resident_streams_into_the_device_stacks(tiny_checkpoint):
    reference = load_model(tiny_checkpoint, progress=False)
    model = load_model(tiny_checkpoint, progress=False, expert_device="meta")
    assert model.layers[0].ffn.routed_weights().w13.device.type == "meta"
    assert model.mtp[0].ffn.routed_weights().w13.device.type == "cpu"  # the drafter's experts load eagerly
    assert install_expert_offload(model, 8) is None
    for streamed, loaded in zip(model.layers, reference.layers, strict=True):
        a, b = streamed.ffn.routed_weights(), loaded.ffn.routed_weights()
        assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("w13", "w13_scale", "w2", "w2_scale"))


class _HostExpertBytes:
    """Routed-expert bytes alive in host memory while loading: the host stores allocated, plus every tensor the
    shard reads returned that is still referenced (freed when its last reference goes); the peak of the sum."""

    def __init__(self) -> None:
        self.stores = self.live = self.peak = 0
        self.reads: Counter[str] = Counter()

    def allocated(self, nbytes: int) -> None:
        self.stores += nbytes
        self.peak = max(self.peak, self.stores + self.live)

    def track(self, key: str, *tensors: torch.Tensor | None) -> None:
        self.reads[key] += 1
        for tensor in tensors:
            if tensor is not None:
                nbytes = tensor.numel() * tensor.element_size()
                self.live += nbytes
                weakref.finalize(tensor, self._free, nbytes)
        self.peak = max(self.peak, self.stores + self.live)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


class _CountingReader:
    def __init__(self, inner, ledger: _HostExpertBytes) -> None:
        self.inner, self.ledger = inner, ledger

    def part(self, key, shape):
        codes, scale = self.inner.part(key, shape)
        self.ledger.track(key, codes, scale)
        return codes, scale

    def row(self, key, index):
        tensor = self.inner.row(key, index)
        self.ledger.track(f"{key}[{index}]", tensor)
        return tensor

    def close(self) -> None:
        self.inner.close()


def test_loading_holds_at_most_the_offloaded_experts_plus_one_in_host_memory(tiny_checkpoint, monkeypatch):
    ledger = _HostExpertBytes()
    allocate = streaming.host_rows

    def counted_host_rows(like, rows, device):
        store = allocate(like, rows, device)
        ledger.allocated(store.nbytes)
        return store

    monkeypatch.setattr(streaming, "host_rows", counted_host_rows)
    model = load_model(tiny_checkpoint, progress=False, expert_device="meta")
    model.deferred_experts.reader = _CountingReader(model.deferred_experts.reader, ledger)
    layers, experts, resident, expert = 4, 8, 3, _expert_bytes(model)
    offload = install_expert_offload(model, resident)
    offloaded = layers * (experts - resident) * expert
    assert ledger.stores == offloaded  # the host stores: the offloaded experts, nothing more
    assert len(ledger.reads) == layers * experts * 3 and set(ledger.reads.values()) == {1}  # each weight once
    assert offloaded < ledger.peak <= offloaded + expert
    assert ledger.live == 0
    assert all(layer.host.weights.num_experts == experts - resident for layer in offload.layers)


def test_a_rebalance_after_a_streamed_load_swaps_experts_and_keeps_the_tokens(tiny_checkpoint, tmp_path):
    """Counts gathered while serving move experts between the device and the store of offloaded experts only
    (a swap through the fetch buffer), before every step, with requests in flight."""
    expected = _tokens(load_model(tiny_checkpoint, progress=False), tiny_checkpoint)
    model = load_model(tiny_checkpoint, progress=False, expert_device="meta")
    offload = install_expert_offload(model, 4, tmp_path / "stats.json", rebalance_every=1)
    moved, rebalance = [], offload.rebalance
    offload.rebalance = lambda *limit: moved.append(rebalance(*limit)) or moved[-1]
    assert _tokens(model, tiny_checkpoint) == expected
    assert len(moved) > 10 and sum(moved) > 0
    for layer in offload.layers:  # the store still holds exactly the experts not resident
        held = {e for e, row in enumerate(layer.host.row_list) if row >= 0}
        assert held == set(range(8)) - set(layer.resident)


def test_deferred_experts_refuse_a_store_of_every_expert(tiny_checkpoint):
    model = load_model(tiny_checkpoint, progress=False, expert_device="meta")
    with pytest.raises(ConfigError, match="host store of the offloaded ones only"):
        install_expert_offload(model, 3, host_keeps_every_expert=True)
