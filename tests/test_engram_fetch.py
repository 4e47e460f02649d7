"""Engram fetch: placements and host methods agree bit for bit, de-duplication and sorting are exact, prefetch API."""

from __future__ import annotations

import multiprocessing
import socket
import threading
import uuid

import pytest
import torch
import torch.distributed as dist

from dsinfer.engram import staged_gather
from dsinfer.engram.fetch import (
    HOST_METHOD_ENV,
    PLACEMENT_ENV,
    DeviceEngramFetcher,
    EngramFetcher,
    HostEngramFetcher,
    ShardedEngramFetcher,
    make_engram_fetcher,
    plan_fetch,
    resolve_host_method,
    resolve_placement,
    shard_bounds,
)
from dsinfer.engram.staged_gather import StagedGather, _records_of
from dsinfer.engram.store import EngramStore, RandomEngramSource
from dsinfer.kernels import engram_gather
from dsinfer.kernels.engram_gather import dequantize_reference, gather_dequantize_reference

ROWS = {1: 3001, 14: 4999}  # odd sizes: shards of unequal length
SMALL_LAUNCH = engram_gather.GatherLaunch(block_rows=16, max_programs=3)  # several persistent steps per program


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
    import dsinfer.engram.fetch.base as fetch_base

    ids = _step_ids(1)[1]  # 53 x 24 ids
    expected = HostEngramFetcher.from_store(store, "cpu").fetch(ids, 1)
    seen = []

    def spy(flat_ids, *, dedup, sort):
        seen.append((flat_ids.numel(), dedup, sort))
        return plan_fetch(flat_ids, dedup=dedup, sort=sort)

    monkeypatch.setattr(fetch_base, "plan_fetch", spy)
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
        out = engram_gather.gather_dequantize(weight, scale, ids, out_dtype=out_dtype, launch=SMALL_LAUNCH)
        assert torch.equal(_bits(out), _bits(gather_dequantize_reference(weight, scale, ids, out_dtype)))
    # Only the first `count` rows are written: a de-duplicated plan leaves the tail alone.
    scale = scale.clone()
    scale[ids[0]] = torch.tensor([0, 1, 126, 127, 128, 200, 254, 120], dtype=torch.uint8)  # 2**-127 .. 2**127
    out = torch.full((150, 256), -7.0)
    launch = engram_gather.GatherLaunch(block_rows=8, max_programs=2)
    engram_gather.gather_dequantize(weight, scale, ids, count=torch.tensor([90]), out=out, out_dtype=torch.float32,
                                    launch=launch)  # fmt: skip
    assert torch.equal(_bits(out[:90]), _bits(gather_dequantize_reference(weight, scale, ids[:90], torch.float32)))
    assert bool((out[90:] == -7.0).all())
    # The store's layout: codes and scales as the two column ranges of 264-byte records.
    records = torch.cat([weight, scale], dim=1)
    out = engram_gather.gather_dequantize(records[:, :256], records[:, 256:], ids, out_dtype=torch.float32,
                                          launch=SMALL_LAUNCH)  # fmt: skip
    assert torch.equal(_bits(out), _bits(gather_dequantize_reference(weight, scale, ids, torch.float32)))
    with pytest.raises(ValueError, match="must have contiguous rows"):
        engram_gather.gather_dequantize(records[:, :256].t().contiguous().t(), records[:, 256:], ids)


def test_fetcher_validates_its_tables():
    with pytest.raises(ValueError, match="at least one table"):
        EngramFetcher({}, device="cpu")
    with pytest.raises(ValueError, match="use_kernel=True needs a CUDA device"):
        EngramFetcher({1: (torch.zeros(1, 256, dtype=torch.uint8),) * 2}, device="cpu", use_kernel=True)


# ------------------------------------------------------------------------------------------ staged host method
STAGED_METHODS = {
    "staged": {"method": "staged"},
    # On CPU the zero-copy share goes through the reference; split_min_ids=0 splits even these small fetches.
    "split 0.3": {"method": "split", "zero_copy_share": 0.3, "split_min_ids": 0},
    "split 1.0": {"method": "split", "zero_copy_share": 1.0, "split_min_ids": 0},  # nothing left to stage
}


def _staged(store, **options) -> HostEngramFetcher:
    options.setdefault("staging_threads", 3)
    options.setdefault("method", "staged")
    return HostEngramFetcher.from_store(store, "cpu", **options)


def _edge_ids(rows: int) -> torch.Tensor:
    """[53, 24] ids with heavy duplication, the first and the last row of the table, and a run of one id."""
    ids = _step_ids(1)[14 if rows == ROWS[14] else 1].clone()
    ids[0, :4] = torch.tensor([0, rows - 1, rows - 1, 0])
    ids[20:30] = rows - 1
    return ids


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, 500, 1 << 20])
@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("method", STAGED_METHODS)
def test_staged_fetch_is_bit_identical_to_the_reference(store, chunk_rows, dedup, method):
    options = STAGED_METHODS[method]
    fetcher = _staged(store, staging_chunk_rows=chunk_rows, dedup=dedup, sort=dedup, out_dtype=torch.float32, **options)
    try:
        assert fetcher.method == options["method"] and fetcher.registration is None
        for layer, rows in ROWS.items():
            weight, scale = store.weight(layer), store.scale(layer)
            ids = _edge_ids(rows)
            expected = gather_dequantize_reference(weight, scale, ids, torch.float32).view(*ids.shape, 256)
            assert torch.equal(_bits(fetcher.fetch(ids, layer)), _bits(expected))
            for count in (1, chunk_rows - 1, chunk_rows, chunk_rows + 1, 2 * chunk_rows):  # chunk boundaries
                if 0 < count <= ids.numel():
                    flat = ids.reshape(-1)[:count]
                    assert torch.equal(_bits(fetcher.fetch(flat, layer)), _bits(expected.reshape(-1, 256)[:count]))
            empty = fetcher.fetch(torch.empty(0, 24, dtype=torch.int64), layer)
            assert empty.shape == (0, 24, 256) and empty.dtype == torch.float32
    finally:
        fetcher.close()


def test_staged_gather_chunks_cover_every_row_once():
    weight = torch.arange(40 * 256, dtype=torch.int32).remainder(251).to(torch.uint8).view(40, 256)
    scale = torch.arange(40 * 8, dtype=torch.uint8).view(40, 8)
    # Chunks of 5 rows, rounds of 12 rows through two rotating buffers: every boundary falls somewhere.
    stager = StagedGather("cpu", threads=3, chunk_rows=5, staging_rows=12, buffers=2)
    try:
        assert stager.chunk_rows_for(4) == 5 and stager.chunk_rows_for(10_000) == 5
        for count in (0, 1, 4, 5, 6, 11, 12, 13, 14, 15, 16, 24, 25, 39, 40, 101):
            ids = torch.randint(0, 40, (count,), generator=torch.Generator().manual_seed(count))
            if count:
                ids[-1] = 39  # the table's last row
            codes, scales = stager.gather(weight, scale, ids)
            assert codes.shape == (count, 256) and scales.shape == (count, 8)
            assert torch.equal(codes, weight[ids]) and torch.equal(scales, scale[ids])
        # Ids outside the table are clamped to it: nothing outside the table is ever read.
        codes, _ = stager.gather(weight, scale, torch.tensor([-3, 45]))
        assert torch.equal(codes, weight[[0, 39]])
        with pytest.raises(ValueError, match="1-D int64 CPU tensor"):
            stager.gather(weight, scale, torch.tensor([1, 2], dtype=torch.int32))
        with pytest.raises(ValueError, match=r"tables must be \[rows, 256\] and \[rows, 8\]"):
            stager.gather(weight[:, :128], scale, torch.tensor([1]))
    finally:
        stager.close()

    wide = StagedGather("cpu", threads=4, chunk_rows=1 << 20)
    try:
        assert wide.chunk_rows_for(10_000) == 2500  # every lane gets work
        wide.gather(weight, scale, torch.zeros(10, dtype=torch.int64))  # staging only as large as needed
        wide.gather(weight, scale, torch.zeros(10_000, dtype=torch.int64))
        wide.gather(weight, scale, torch.zeros(7, dtype=torch.int64))  # the first buffer again, large enough
        assert [buffer.rows for buffer in wide._staging] == [10, 10_000]
    finally:
        wide.close()
    with pytest.raises(ValueError, match="staging threads must be a positive integer"):
        StagedGather("cpu", threads=0)


def test_staged_gather_reads_records_whole():
    """The store's tables (column ranges of one record table) are gathered as records; separate tables still work."""
    records = torch.arange(40 * 264, dtype=torch.int32).remainder(253).to(torch.uint8).view(40, 264)
    weight, scale = records[:, :256], records[:, 256:]
    assert _records_of(weight, scale) is not None and _records_of(weight.clone(), scale.clone()) is None
    assert _records_of(records[:, :256], records[:, 8:16]) is None  # not the record's own scales
    stager = StagedGather("cpu", threads=2, chunk_rows=4, staging_rows=10)
    try:
        for separate in (False, True):
            tables = (weight.contiguous(), scale.contiguous()) if separate else (weight, scale)
            ids = torch.tensor([39, 0, 7, 7, 22, 5, 38, 1, 2, 3, 4, 9, 11], dtype=torch.int64)
            codes, scales = stager.gather(*tables, ids)
            assert torch.equal(codes, weight[ids]) and torch.equal(scales, scale[ids])
    finally:
        stager.close()


def test_staged_gather_reports_a_lane_failure(monkeypatch):
    gather = staged_gather._Round.gather

    def failing_gather(job, start, stop):
        if start >= 3 * 1024:
            raise RuntimeError("lane failed")
        gather(job, start, stop)

    monkeypatch.setattr(staged_gather._Round, "gather", failing_gather)
    stager = StagedGather("cpu", threads=2, chunk_rows=1024)
    try:
        weight, scale = torch.zeros(10, 256, dtype=torch.uint8), torch.zeros(10, 8, dtype=torch.uint8)
        with pytest.raises(RuntimeError, match="lane failed"):
            stager.gather(weight, scale, torch.zeros(8 * 1024, dtype=torch.int64))
        assert stager.gather(weight, scale, torch.zeros(3 * 1024, dtype=torch.int64))[0].shape == (3 * 1024, 256)
    finally:
        stager.close()


@pytest.mark.parametrize("method", STAGED_METHODS)
def test_staged_prefetch_runs_on_a_worker_in_layer_order(store, monkeypatch, method):
    """start() returns while the gathers still run; wait() joins each layer in any order; layers go earliest first."""
    fetcher = _staged(store, staging_chunk_rows=64, **STAGED_METHODS[method])
    ids = {layer: _edge_ids(rows) for layer, rows in ROWS.items()}
    expected = {layer: fetcher.fetch(ids[layer], layer) for layer in ROWS}
    release, order = threading.Event(), []
    gather = fetcher._stager.gather

    def held_gather(weight, scale, row_ids, **kwargs):
        order.append(next(layer for layer, table in fetcher.host_tables.items() if table[0] is weight))
        assert release.wait(timeout=30)
        return gather(weight, scale, row_ids, **kwargs)

    monkeypatch.setattr(fetcher._stager, "gather", held_gather)
    try:
        fetcher.start({14: ids[14], 1: ids[1]})  # returns although no gather can finish yet
        assert all(not job.done() for job in fetcher._pending.values())
        release.set()
        assert torch.equal(fetcher.wait(14), expected[14])  # collected out of order
        assert torch.equal(fetcher.wait(1), expected[1])
        assert order == [1, 14]
        with pytest.raises(KeyError, match="no prefetch pending for Engram layer 1"):
            fetcher.wait(1)

        # A layer started again replaces its earlier request; an empty request yields no rows.
        fetcher.start({1: ids[1][:3], 14: torch.empty(0, 24, dtype=torch.int64)})
        fetcher.start({1: ids[1][3:9]})
        assert torch.equal(fetcher.wait(1), expected[1][3:9])
        assert fetcher.wait(14).shape == (0, 24, 256)
    finally:
        fetcher.close()
    assert fetcher._worker is None and not fetcher._pending


def test_small_split_fetches_read_zero_copy_alone(store, monkeypatch):
    """Below split_min_ids a split fetcher skips the host round trip: the stager is never called."""
    fetcher = _staged(store, method="split", split_min_ids=1000)
    calls = []
    gather = fetcher._stager.gather
    monkeypatch.setattr(fetcher._stager, "gather", lambda *args, **kwargs: calls.append(1) or gather(*args, **kwargs))
    try:
        small, large = _edge_ids(ROWS[1])[:40], _edge_ids(ROWS[1])  # 960 and 1272 ids
        expected = {
            name: gather_dequantize_reference(store.weight(1), store.scale(1), ids).view(*ids.shape, 256)
            for name, ids in (("small", small), ("large", large))
        }
        assert torch.equal(fetcher.fetch(small, 1), expected["small"]) and not calls
        fetcher.start({1: small})
        assert isinstance(fetcher._pending[1], tuple)  # computed at once, no worker job
        assert torch.equal(fetcher.wait(1), expected["small"]) and not calls
        assert torch.equal(fetcher.fetch(large, 1), expected["large"]) and len(calls) == 1
        fetcher.start({1: large, 14: _edge_ids(ROWS[14])[:2]})
        assert torch.equal(fetcher.wait(1), expected["large"]) and len(calls) == 2
        assert fetcher.wait(14).shape == (2, 24, 256) and len(calls) == 2
    finally:
        fetcher.close()


def test_staged_prefetch_errors_reach_wait(store, monkeypatch):
    fetcher = _staged(store)
    try:
        with pytest.raises(ValueError, match=r"row ids of layer 1 must lie in \[0, 3001\)"):
            fetcher.start({1: torch.tensor([[0, 3001]])})  # checked on the caller's thread, before any gather

        def broken_gather(*args, **kwargs):
            raise RuntimeError("staging failed")

        monkeypatch.setattr(fetcher._stager, "gather", broken_gather)
        fetcher.start({1: _edge_ids(ROWS[1])})
        with pytest.raises(RuntimeError, match="staging failed"):
            fetcher.wait(1)
        with pytest.raises(KeyError, match="no prefetch pending"):
            fetcher.wait(1)
    finally:
        fetcher.close()


def test_host_method_choice(store, monkeypatch):
    monkeypatch.delenv(HOST_METHOD_ENV, raising=False)
    assert resolve_host_method(None) == "zero_copy"
    assert resolve_host_method("Staged") == "staged" and resolve_host_method("zero-copy") == "zero_copy"
    monkeypatch.setenv(HOST_METHOD_ENV, "staged")
    assert resolve_host_method(None) == "staged" and resolve_host_method("zero_copy") == "zero_copy"
    fetcher = make_engram_fetcher(store, "host", device="cpu", staging_threads=2)
    assert isinstance(fetcher, HostEngramFetcher) and fetcher.method == "staged" and fetcher._stager.threads == 2
    fetcher.close()
    # Host-only options do not bother the other placements, so one set of options serves all of them.
    device = make_engram_fetcher(store, "device", device="cpu", host_method="staged", staging_chunk_rows=64)
    assert isinstance(device, DeviceEngramFetcher)
    monkeypatch.setenv(HOST_METHOD_ENV, "dma")
    with pytest.raises(ValueError, match=f"{HOST_METHOD_ENV} must be one of zero_copy, staged, split, got 'dma'"):
        resolve_host_method(None)
    with pytest.raises(ValueError, match="host_method must be one of"):
        make_engram_fetcher(store, "host", device="cpu", host_method="rdma")
    with pytest.raises(ValueError, match="scales_on_device applies to the zero_copy host method, not staged"):
        HostEngramFetcher.from_store(store, "cpu", method="staged", scales_on_device=True)
    with pytest.raises(ValueError, match="staged host method reads uint8 tables with contiguous rows in host memory"):
        HostEngramFetcher({1: (torch.zeros(1, 256), torch.zeros(1, 8))}, device="cpu", method="staged")
    with pytest.raises(ValueError, match=r"zero_copy_share must lie in \[0, 1\], got 1.5"):
        HostEngramFetcher.from_store(store, "cpu", method="split", zero_copy_share=1.5)
    table = (store.weight(1), store.scale(1))
    with pytest.raises(ValueError, match=r"host_tables hold layers \[14\], the tables \[1\]"):
        HostEngramFetcher({1: table}, device="cpu", method="split", host_tables={14: table})


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 2**127 scales overflow, as intended
def test_dequantize_rows_kernel_matches_reference_in_the_interpreter(monkeypatch):
    """The staged method's dequantisation (the gather kernel without its gather) in Triton's CPU interpreter."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    kernel = engram_gather._gather_dequantize_kernel
    monkeypatch.setattr(engram_gather, "_gather_dequantize_kernel", interpreter.InterpretedFunction(kernel.fn))
    weight, scale = _tables()[1]
    codes, scales = weight[:77].clone(), scale[:77].clone()
    scales[3] = torch.tensor([0, 1, 126, 127, 128, 200, 254, 120], dtype=torch.uint8)  # 2**-127 .. 2**127
    for out_dtype in (torch.bfloat16, torch.float32):
        out = engram_gather.dequantize_rows(codes, scales, out_dtype=out_dtype, launch=SMALL_LAUNCH)
        expected = dequantize_reference(codes, scales, out_dtype)
        realistic = torch.arange(77) != 3  # bf16 subnormals (2**-127 scales) may round differently in the interpreter
        assert torch.equal(_bits(out[realistic]), _bits(expected[realistic]))
        if out_dtype == torch.float32:
            assert torch.equal(_bits(out), _bits(expected))
    assert engram_gather.dequantize_rows(codes[:0], scales[:0]).shape == (0, 256)
