"""What a graphed speculative round costs the host and the device, in counts rather than time: one host read a
round and a handful of ops outside the replayed region (each a kernel launch on a GPU), and a rollback that
restores each cache tensor with one scatter, never reading it back.

The engine is the static-shape path of tests/test_spec_graphs.py (buckets run eagerly on the CPU): three
sequences of the tiny V4.1 checkpoint drafting with DSpark in bucket 4.
"""

from __future__ import annotations

import pytest
import torch
from engine_harness import random_prompts
from torch.utils._python_dispatch import TorchDispatchMode

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.is_nonzero.default}
ROUNDS = 4
OPS_OUTSIDE_REPLAYS = 12  # a round's ops outside the replays: filling the verify inputs, the result's read


@pytest.fixture(scope="module")
def steady_engine(tiny_v41_checkpoint) -> LLMEngine:
    """Three sequences decoding with K = 3 DSpark drafts in bucket 4, every step served by the graphs' path."""
    model = load_model(tiny_v41_checkpoint, progress=False).set_fake_quantization(False)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160, cuda_graph_sizes=(1, 2, 4),
                          speculative_config={"method": "dspark", "num_speculative_tokens": 3})  # fmt: skip
    engine = LLMEngine(model, Tokenizer.from_dir(tiny_v41_checkpoint), config)
    for prompt in random_prompts(3, seed=7, low=12, high=30):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    executor = engine.worker.speculative
    while executor.graphed_steps < 2:
        engine.step()
    return engine


class RoundCounter(TorchDispatchMode):
    """Ops and host reads outside the replayed region (``replaying`` marks the inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.replaying = False
        self.ops = self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.replaying:
            self.ops += 1
            self.reads += func in HOST_READS
        return func(*args, **(kwargs or {}))


def _mark_replays(graphs, counter: RoundCounter, monkeypatch) -> None:
    for name in ("_verify_forward", "_judge_forward", "_draft_forward"):
        method = getattr(graphs, name)

        def replayed(*args, method=method, **kwargs):
            counter.replaying = True
            try:
                return method(*args, **kwargs)
            finally:
                counter.replaying = False

        monkeypatch.setattr(graphs, name, replayed)


def test_a_graphed_round_reads_the_host_once_and_launches_little_outside_its_replays(steady_engine, monkeypatch):
    executor = steady_engine.worker.speculative
    counter, host_lists = RoundCounter(), [0]
    _mark_replays(executor.graphs, counter, monkeypatch)
    tolist = torch.Tensor.tolist

    def counted_tolist(tensor):
        host_lists[0] += not counter.replaying
        return tolist(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    graphed = executor.graphed_steps
    with counter:
        for _ in range(ROUNDS):
            steady_engine.step()
    assert executor.graphed_steps - graphed == ROUNDS
    assert (host_lists[0], counter.reads) == (ROUNDS, 0)  # the round's result, read once
    assert counter.ops <= OPS_OUTSIDE_REPLAYS * ROUNDS


class CacheAccess(TorchDispatchMode):
    """Reads and writes of the given cache tensors (by storage), by op."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = {tensor.untyped_storage().data_ptr() for tensor in tensors}
        self.reads = self.writes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.untyped_storage().data_ptr() in self.storages:
            if func in (aten.index_put_.default, aten._index_put_impl_.default):
                self.writes += 1
            elif func is aten.index.Tensor:
                self.reads += 1
        return func(*args, **(kwargs or {}))


def _rollback_access(engine: LLMEngine, tensors: list[torch.Tensor], monkeypatch) -> CacheAccess:
    """Reads and writes of ``tensors`` by the graphed rollback during one engine step."""
    fixed = engine.worker.speculative.graphs.fixed_rollback
    access = CacheAccess(tensors)
    rollback = fixed.rollback

    def watched(*args, **kwargs):
        with access:
            return rollback(*args, **kwargs)

    monkeypatch.setattr(fixed, "rollback", watched)
    engine.step()
    return access


def test_the_graphed_rollback_restores_each_ring_stack_and_entry_tensor_with_one_scatter(steady_engine, monkeypatch):
    """Every layer's ring rows come back in one scatter a stack (values, or codes and scales), each entry tensor's
    in one scatter, and none of them is read."""
    fixed = steady_engine.worker.speculative.graphs.fixed_rollback
    assert all(stack.shape[0] > 1 for stack in fixed.ring_stacks)  # the stacks hold several layers' rings
    restored = list(fixed.ring_stacks) + [entries for compressor in fixed.compressors for entries in compressor.entries]
    access = _rollback_access(steady_engine, restored, monkeypatch)
    assert (access.writes, access.reads) == (len(restored), 0)


def test_the_graphed_rollback_restores_each_unfinished_window_with_one_scatter(steady_engine, monkeypatch):
    """The compressors' unfinished windows (and an overlapping compressor's last complete one) are written back as
    the rings are: one scatter each, the rows that stay sent to the spare slot, the state never read."""
    fixed = steady_engine.worker.speculative.graphs.fixed_rollback
    windows = [state for compressor in fixed.compressors for states in (compressor.pending, compressor.previous)
               if states is not None for state in states]  # fmt: skip
    assert windows  # the tiny V4.1's ratio-2 sources keep unfinished windows
    access = _rollback_access(steady_engine, windows, monkeypatch)
    assert (access.writes, access.reads) == (len(windows), 0)
