"""Engram fetch: the three placements agree bit for bit, de-duplication and sorting are exact, prefetch API."""

from __future__ import annotations

import multiprocessing
import socket
import uuid

import pytest
import torch
import torch.distributed as dist

from dsinfer.engram.fetch import (
    PLACEMENT_ENV,
    DeviceEngramFetcher,
    EngramFetcher,
    HostEngramFetcher,
    ShardedEngramFetcher,
    make_engram_fetcher,
    plan_fetch,
    resolve_placement,
    shard_bounds,
)
from dsinfer.engram.store import EngramStore, RandomEngramSource
from dsinfer.kernels import engram_gather
from dsinfer.kernels.engram_gather import gather_dequantize_reference

ROWS = {1: 3001, 14: 4999}  # odd sizes: shards of unequal length


def _source() -> RandomEngramSource:
    return RandomEngramSource(ROWS, seed=11)


def _tables() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    source = _source()
    tables = {}
    for layer in ROWS:
        codes, scales = source.expected(layer)
        tables[layer] = (torch.from_numpy(codes), torch.from_numpy(scales))
    return tables


def _step_ids(rank: int) -> dict[int, torch.Tensor]:
    """Per-layer ids [T, 24] of one rank's step, with heavy duplication (as n-gram hashes of text have)."""
    generator = torch.Generator().manual_seed(100 + rank)
    ids = {}
    for layer, rows in ROWS.items():
        tokens = 0 if (rank, layer) == (0, 14) else 40 + 13 * rank  # one rank asks nothing of one layer
        step = torch.randint(0, rows, (tokens, 24), generator=generator)
        if tokens:
            step[5:15] = step[0]
            step[:, 3] = rows - 1  # the last row of the table, on the last shard
        ids[layer] = step
    return ids


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x.view(torch.int32)


def _sharded_results(rank: int) -> dict[str, torch.Tensor]:
    fetcher = ShardedEngramFetcher.from_tables(_tables(), device="cpu")
    ids = _step_ids(rank)
    results = {f"fetch.{layer}": fetcher.fetch(ids[layer], layer) for layer in ROWS}
    fetcher.start(ids)
    for layer in ROWS:
        results[f"prefetch.{layer}"] = fetcher.wait(layer)
    return results


def _sharded_rank(rank: int, port: int, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.save(_sharded_results(rank), out_path)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def store():
    with EngramStore.create(f"dsinfer-test-{uuid.uuid4().hex[:12]}", _source()) as segment:
        yield segment


def test_three_placements_are_bit_identical(store, tmp_path):
    host = make_engram_fetcher(store, "host", device="cpu")
    device = make_engram_fetcher(store, "device", device="cpu")
    assert isinstance(host, HostEngramFetcher) and isinstance(device, DeviceEngramFetcher)
    assert host.tables[1][0].data_ptr() == store.weight(1).data_ptr()  # reads the segment in place
    assert device.tables[1][0].data_ptr() != store.weight(1).data_ptr()  # a private copy

    # Rank 1 of the sharded placement runs in a second process; this process is rank 0.
    port, out_path = _free_port(), tmp_path / "rank1.pt"
    child = multiprocessing.get_context("spawn").Process(target=_sharded_rank, args=(1, port, str(out_path)))
    child.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    try:
        sharded = {0: _sharded_results(0)}
    finally:
        dist.destroy_process_group()
    child.join(timeout=120)
    assert child.exitcode == 0
    sharded[1] = torch.load(out_path)

    for rank in (0, 1):
        for layer, ids in _step_ids(rank).items():
            expected = host.fetch(ids, layer)
            assert expected.shape == (*ids.shape, 256) and expected.dtype == torch.bfloat16
            assert torch.equal(_bits(device.fetch(ids, layer)), _bits(expected))
            assert torch.equal(_bits(sharded[rank][f"fetch.{layer}"]), _bits(expected))
            assert torch.equal(_bits(sharded[rank][f"prefetch.{layer}"]), _bits(expected))


@pytest.mark.parametrize(("dedup", "sort"), [(True, True), (False, True), (False, False)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fetch_equals_the_row_by_row_reference(store, dedup, sort, out_dtype):
    fetcher = HostEngramFetcher.from_store(store, "cpu", dedup=dedup, sort=sort, out_dtype=out_dtype)
    ids = _step_ids(1)[14]
    weight, scale = store.weight(14), store.scale(14)
    expected = torch.stack([gather_dequantize_reference(weight, scale, row, out_dtype) for row in ids])
    assert torch.equal(_bits(fetcher.fetch(ids, 14)), _bits(expected))
    # Spot-check the formula itself: code * 2**(scale - 127), scales per 32 channels.
    row, column = int(ids[7, 5]), 70
    code = weight[row, column : column + 1].view(torch.float8_e4m3fn).float()
    value = code * 2.0 ** (int(scale[row, column // 32]) - 127)
    assert fetcher.fetch(ids, 14)[7, 5, column].float() == value.to(out_dtype).float()


def test_plan_sorts_and_deduplicates():
    generator = torch.Generator().manual_seed(3)
    flat = torch.randint(0, 50, (500,), generator=generator)
    plan = plan_fetch(flat)
    count = int(plan.count)
    assert torch.equal(plan.ids[:count], torch.unique(flat))  # sorted, each id once
    assert torch.equal(plan.ids[:count][plan.inverse], flat)  # the inverse rebuilds the request
    assert count < 51 and plan.ids.numel() == flat.numel()  # fixed capacity: no host sync needed on GPU

    plan = plan_fetch(flat, dedup=False, sort=True)
    assert int(plan.count) == 500 and torch.equal(plan.ids, flat.sort().values)
    assert torch.equal(plan.ids[plan.inverse], flat)

    plan = plan_fetch(flat, dedup=False, sort=False)
    assert plan.inverse is None and torch.equal(plan.ids, flat)
    assert int(plan_fetch(torch.empty(0, dtype=torch.int64)).count) == 0


def test_small_fetches_skip_the_plan(store, monkeypatch):
    import dsinfer.engram.fetch as fetch_module

    ids = _step_ids(1)[1]  # 53 x 24 ids
    expected = HostEngramFetcher.from_store(store, "cpu").fetch(ids, 1)
    seen = []

    def spy(flat_ids, *, dedup, sort):
        seen.append((flat_ids.numel(), dedup, sort))
        return plan_fetch(flat_ids, dedup=dedup, sort=sort)

    monkeypatch.setattr(fetch_module, "plan_fetch", spy)
    fetcher = HostEngramFetcher.from_store(store, "cpu", dedup_min_ids=100)
    assert torch.equal(fetcher.fetch(ids[:4], 1), expected[:4])  # 96 ids: request order
    assert torch.equal(fetcher.fetch(ids, 1), expected)  # 1272 ids: sorted and de-duplicated
    assert seen == [(96, False, False), (1272, True, True)]


def test_prefetch_api(store):
    fetcher = HostEngramFetcher.from_store(store, "cpu")
    ids = _step_ids(1)
    fetcher.start(ids)
    assert torch.equal(fetcher.wait(14), fetcher.fetch(ids[14], 14))
    assert torch.equal(fetcher.wait(1), fetcher.fetch(ids[1], 1))
    with pytest.raises(KeyError, match="no prefetch pending for Engram layer 1"):
        fetcher.wait(1)
    with pytest.raises(KeyError, match="no Engram table for layer 2"):
        fetcher.start({2: ids[1]})


def test_bad_ids_are_rejected(store):
    fetcher = HostEngramFetcher.from_store(store, "cpu")
    with pytest.raises(ValueError, match=r"row ids of layer 1 must lie in \[0, 3001\)"):
        fetcher.fetch(torch.tensor([[0, 3001]]), 1)
    with pytest.raises(ValueError, match="integer tensor"):
        fetcher.fetch(torch.zeros(2, 3), 1)
    with pytest.raises(ValueError, match="layer_id is required"):
        fetcher.fetch(torch.zeros(2, 3, dtype=torch.int64))


def test_placement_choice(monkeypatch):
    monkeypatch.delenv(PLACEMENT_ENV, raising=False)
    assert resolve_placement(None, table_bytes=10**12, device="cpu") == "device"
    assert resolve_placement(None, table_bytes=10, device="cuda", device_memory_budget=5) == "host"
    assert resolve_placement(None, table_bytes=5, device="cuda", device_memory_budget=5) == "device"
    monkeypatch.setenv(PLACEMENT_ENV, "Sharded")
    assert resolve_placement(None, table_bytes=5, device="cpu") == "sharded"
    assert resolve_placement("host", table_bytes=5, device="cpu") == "host"  # the flag wins
    monkeypatch.setenv(PLACEMENT_ENV, "pcie")
    with pytest.raises(ValueError, match=f"{PLACEMENT_ENV} must be one of device, host, sharded, got 'pcie'"):
        resolve_placement(None, table_bytes=5, device="cpu")
    with pytest.raises(ValueError, match="--engram-placement must be one of"):
        resolve_placement("rdma", table_bytes=5, device="cpu")


def test_sharded_needs_a_process_group():
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed process group"):
        ShardedEngramFetcher({1: (torch.zeros(1, 256, dtype=torch.uint8),) * 2}, {1: 1}, device="cpu")
    assert shard_bounds(10, 3) == [0, 3, 6, 10]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 2**127 scales overflow, as intended
def test_triton_kernel_matches_reference_in_the_interpreter(monkeypatch):
    """The Triton kernel, run by Triton's CPU interpreter, against the torch reference (CUDA runs it for real)."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    kernel = engram_gather._gather_dequantize_kernel
    monkeypatch.setattr(engram_gather, "_gather_dequantize_kernel", interpreter.InterpretedFunction(kernel.fn))
    weight, scale = _tables()[1]
    ids = torch.randint(0, weight.shape[0], (150,), generator=torch.Generator().manual_seed(5))
    for out_dtype in (torch.bfloat16, torch.float32):
        out = engram_gather.gather_dequantize(weight, scale, ids, out_dtype=out_dtype, max_programs=3, block_rows=16)
        assert torch.equal(_bits(out), _bits(gather_dequantize_reference(weight, scale, ids, out_dtype)))
    # Only the first `count` rows are written: a de-duplicated plan leaves the tail alone.
    scale = scale.clone()
    scale[ids[0]] = torch.tensor([0, 1, 126, 127, 128, 200, 254, 120], dtype=torch.uint8)  # 2**-127 .. 2**127
    out = torch.full((150, 256), -7.0)
    engram_gather.gather_dequantize(
        weight, scale, ids, count=torch.tensor([90]), out=out, out_dtype=torch.float32, max_programs=2, block_rows=8
    )
    assert torch.equal(_bits(out[:90]), _bits(gather_dequantize_reference(weight, scale, ids[:90], torch.float32)))
    assert bool((out[90:] == -7.0).all())


def test_fetcher_validates_its_tables():
    with pytest.raises(ValueError, match="at least one table"):
        EngramFetcher({}, device="cpu")
    with pytest.raises(ValueError, match="use_kernel=True needs a CUDA device"):
        EngramFetcher({1: (torch.zeros(1, 256, dtype=torch.uint8),) * 2}, device="cpu", use_kernel=True)
