"""The sweep tool on the CPU with the tiny checkpoint: consistent numbers, both accountings, a real PNG, rank 0 only."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from dsinfer.bench import pareto, sweep, sweep_options, sweep_timing
from dsinfer.engine.engine import StepStats

CONTEXT = 64
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sweep_args(checkpoint, out_root, mode, points, *extra):
    return [mode, "--model", str(checkpoint), "--context", str(CONTEXT), "--points", points, "--device", "cpu",
            "--warmup-steps", "1", "--measure-steps", "3", "--cache-gib", "0.0625", "--out-root", str(out_root),
            *extra]  # fmt: skip


def read_records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def decode_sweep(tiny_checkpoint, tmp_path_factory):
    out_root = tmp_path_factory.mktemp("sweeps")
    args = sweep_args(tiny_checkpoint, out_root, "decode", "1,2", "--tag", "ce", "--nextn", "3", "--accept", "0.75")
    assert sweep.main(args) == 0
    return out_root / "ce"


@pytest.fixture(scope="module")
def prefill_sweep(tiny_checkpoint, tmp_path_factory):
    out_root = tmp_path_factory.mktemp("sweeps")
    assert sweep.main(sweep_args(tiny_checkpoint, out_root, "prefill", "32,128", "--tag", "pe")) == 0
    return out_root / "pe"


def assert_consistent(record):
    """tokens/s = tokens/step / s/step, and the mean step time is the measured time over the steps."""
    seconds_per_step = record["ms_per_step"] / 1e3
    assert record["tokens_per_s_per_gpu"] == pytest.approx(record["tokens_per_step"] / seconds_per_step, rel=1e-9)
    assert record["measured_s"] == pytest.approx(record["steps"] * seconds_per_step, rel=1e-9)
    assert record["min_ms_per_step"] <= record["median_ms_per_step"] <= record["max_ms_per_step"]
    assert record["min_ms_per_step"] <= record["p90_ms_per_step"] <= record["max_ms_per_step"]
    assert record["min_ms_per_step"] <= record["ms_per_step"] <= record["max_ms_per_step"]
    assert record["irregular_steps"] == 0 and record["preemptions"] == 0
    assert sum(record["step_time_share"].values()) == pytest.approx(1.0)
    collector = record["gc"]  # the collector's pauses fit inside the timed steps
    assert len(collector["collections"]) == 3 and 0 <= collector["longest_ms"] <= collector["ms"]
    assert collector["ms"] <= 1e3 * record["measured_s"]


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 10_000  # axes, two labelled series: not an empty canvas
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG" and image.width >= 600 and image.height >= 400


def test_decode_records(decode_sweep):
    records = read_records(decode_sweep / "results.jsonl")
    assert [r["point"] for r in records] == [1, 2]
    for record in records:
        assert_consistent(record)
        n = record["point"]
        assert record["mode"] == "decode" and record["point_unit"] == "requests per DP rank"
        assert record["steps"] == 3 and record["warmup_steps"] == 1
        assert record["tokens_per_step"] == n  # one token per sequence per step
        assert record["context"] == CONTEXT and CONTEXT < record["context_range"][0] <= record["context_range"][1]
        seconds_per_step = record["ms_per_step"] / 1e3
        assert record["tokens_per_step_per_user"] == 1.0
        assert record["tokens_per_s_per_user"] == pytest.approx(1.0 / seconds_per_step, rel=1e-9)
        assert record["engine"]["max_num_seqs"] == n and record["engine"]["enable_prefix_caching"] is False
        assert record["weights"] == "checkpoint" and record["model"].startswith("checkpoint ")
        assert record["gpu_name"] == "cpu" and record["device"] == "cpu" and record["dtype"] == "float32"
        assert record["dp_rank"] == 0 and record["world_size"] == 1 and record["timestamp"].endswith("+00:00")


def test_decode_speculative_accountings(decode_sweep):
    for record in read_records(decode_sweep / "results.jsonl"):
        seconds_per_step = record["ms_per_step"] / 1e3
        assert record["nextn"] == 3 and record["accept"] == 0.75
        assert record["speculative"] == "not run, measured = no drafts"
        measured, assumed = record["measured"], record["assumed"]
        assert measured["tokens_per_step_per_user"] == 1.0
        assert measured["tokens_per_s_per_gpu"] == record["tokens_per_s_per_gpu"]
        assert measured["tokens_per_s_per_user"] == record["tokens_per_s_per_user"]
        assert assumed["tokens_per_step_per_user"] == 3.25  # 1 + 3 x 0.75, the official tau
        assert assumed["tokens_per_s_per_user"] == pytest.approx(3.25 / seconds_per_step, rel=1e-9)
        assert assumed["tokens_per_s_per_gpu"] == pytest.approx(record["point"] * 3.25 / seconds_per_step, rel=1e-9)
        assert assumed["chained_tokens_per_step"] == pytest.approx(1 + 0.75 + 0.75**2 + 0.75**3)


def test_decode_files(decode_sweep):
    assert_png(decode_sweep / "pareto.png")
    summary = json.loads((decode_sweep / "summary.json").read_text())
    assert summary["points"] == [1, 2] and summary["skipped"] == [] and summary["pareto"] == "pareto.png"
    assert summary["telemetry"] is None  # CPU run: no GPU to sample
    assert not (decode_sweep / "telemetry.csv").exists()


def test_prefill_records_and_chart(prefill_sweep):
    records = read_records(prefill_sweep / "results.jsonl")
    assert [r["point"] for r in records] == [32, 128]
    for record in records:
        assert_consistent(record)
        assert record["mode"] == "prefill" and record["throughput_kind"] == "uncached input tokens"
        assert record["tokens_per_step"] == record["point"]  # every timed step prefills exactly p new tokens
        assert record["tokens_per_s_per_user"] is None and "assumed" not in record
        assert record["engine"]["max_num_batched_tokens"] == record["point"]
        assert record["covers_full_cycle"] is True
    # 32 of a 64-token prompt per step: positions repeat every 2 steps, so 3 requested steps become 4.
    assert (records[0]["position_cycle_steps"], records[0]["steps"]) == (2, 4)
    assert (records[1]["position_cycle_steps"], records[1]["steps"]) == (1, 3)
    assert_png(prefill_sweep / "pareto.png")


def test_pareto_redraws_from_results(prefill_sweep, tmp_path):
    out = tmp_path / "again.png"
    assert pareto.main([str(prefill_sweep / "results.jsonl"), "--out", str(out), "--compare-published"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_only_rank_zero_writes(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("DP_RANK", raising=False)
    args = sweep_args(tiny_checkpoint, tmp_path / "sweeps", "decode", "1", "--tag", "r1", "--measure-steps", "1")
    assert sweep.main(args) == 0
    assert not (tmp_path / "sweeps").exists()
    captured = capsys.readouterr()
    assert "dp_rank 1" in captured.err and "decode point" in captured.out  # it ran, it did not write


def test_dp_rank_prefers_dp_rank_over_rank(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("DP_RANK", "0")
    assert sweep_options.dp_rank() == 0
    monkeypatch.delenv("DP_RANK")
    assert sweep_options.dp_rank() == 3
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK"):
        sweep_options.dp_rank()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["decode", "--points", "1,x"], "--points"),
        (["decode", "--points", "0"], "--points"),
        (["decode", "--accept", "1.5"], "--accept"),
        (["prefill", "--nextn", "3"], "--nextn"),
        (["decode", "--tag", "../escape"], "--tag"),
        (["decode", "--measure-steps", "0"], "--measure-steps"),
        (["decode", "--profile-steps", "-1"], "--profile-steps"),
        (["decode", "--model", "/no/such/dir"], "--model"),
    ],
)
def test_bad_options_are_one_clear_error(argv, message, tmp_path, capsys):
    assert sweep.main([*argv, "--device", "cpu", "--out-root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsinfer bench sweep: error:") and message in err
    assert not any(tmp_path.iterdir())


def test_context_beyond_the_model_names_the_flag(tiny_checkpoint, tmp_path, capsys):
    argv = ["decode", "--model", str(tiny_checkpoint), "--context", "131072", "--out-root", str(tmp_path)]
    assert sweep.main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--context 131072" in err and "max_position_embeddings (4096)" in err
    assert not any(tmp_path.iterdir())


def test_step_statistics_arithmetic():
    timed = [(0.1, StepStats(0.01, 0.08, 0.01, 4)), (0.3, StepStats(0.0, 0.3, 0.0, 4)), (0.2, StepStats(0, 0.2, 0, 3))]
    stats = sweep_timing.step_statistics(timed, expected_tokens=4)
    assert stats["ms_per_step"] == pytest.approx(200.0)
    assert stats["median_ms_per_step"] == pytest.approx(200.0)
    assert stats["tokens_per_step"] == pytest.approx(11 / 3)
    assert stats["tokens_per_s_per_gpu"] == pytest.approx(11 / 0.6)
    assert stats["irregular_steps"] == 1 and stats["steps"] == 3
    assert stats["step_time_share"]["schedule"] == pytest.approx(0.01 / 0.6)


class _QueuedWorkEngine:
    """An engine whose step launches ``work_s`` of device work and returns at once; a drain runs what is queued
    (as ``torch.cuda.synchronize`` waits for launched kernels)."""

    def __init__(self, work_s: float):
        self.work_s, self.queued, self.last_step = work_s, 0, None

    def has_unfinished_requests(self) -> bool:
        return True

    def step(self) -> None:
        self.queued += 1
        self.last_step = StepStats(0.0, 0.0, 0.0, 1)

    def drain(self) -> None:
        time.sleep(self.queued * self.work_s)
        self.queued = 0


def test_timed_steps_hold_exactly_their_own_device_work(monkeypatch):
    engine = _QueuedWorkEngine(work_s=0.05)
    engine.queued = 5  # untimed steps' work still in flight when the window opens: 0.25 s
    monkeypatch.setattr(sweep_timing, "drain_device", lambda e: e.drain())
    timed, _, window = sweep_timing.timed_steps(engine, 3)
    seconds = sum(s for s, _ in timed)
    assert 0.15 <= seconds < 0.35  # the three timed steps' work (0.15 s): none of the five before, all of their own
    assert timed[-1][0] >= 0.15 and engine.queued == 0
    assert window[1] - window[0] >= 0.15


def test_a_drain_waits_for_the_step_the_worker_is_still_launching():
    """The engine thread hands a step to its device worker and returns; the worker may launch the step's kernels
    after a device synchronize from the engine thread has returned. A drain waits on the worker, behind it."""
    import threading
    from types import SimpleNamespace

    from dsinfer.engine.device_worker import DeviceWorker

    worker = DeviceWorker(runner=None, sampler=None)
    try:
        launched = threading.Event()
        worker._pool.submit(lambda: (time.sleep(0.2), launched.set()))  # a step still on its way to the device
        sweep_timing.drain_device(SimpleNamespace(worker=worker, config=SimpleNamespace(device="cpu")))
        assert launched.is_set()
    finally:
        worker.close()


def test_prefill_measure_steps_cover_whole_position_cycles():
    assert sweep_timing.prefill_measure_steps(131072, 4096, 10) == (32, 32)
    assert sweep_timing.prefill_measure_steps(131072, 65536, 10) == (10, 2)
    assert sweep_timing.prefill_measure_steps(64, 128, 3) == (3, 1)
    cycle = math.lcm(100003, 7) // 7
    assert sweep_timing.prefill_measure_steps(100003, 7, 5) == (5, cycle)  # too long a cycle: left as asked


def test_speculative_accounting_without_drafts():
    accounting = sweep_timing.speculative_accounting(0, 0.75, 8, {"ms_per_step": 50.0, "tokens_per_step": 8.0,
                                                           "tokens_per_s_per_gpu": 160.0})  # fmt: skip
    assert accounting["speculative"] == "off (nextn = 0)"
    assert accounting["assumed"]["tokens_per_step_per_user"] == 1.0
    assert accounting["assumed"]["tokens_per_s_per_gpu"] == pytest.approx(160.0)
    assert accounting["measured"]["tokens_per_s_per_user"] == pytest.approx(20.0)


def test_decode_sweep_with_real_drafts_reports_the_measured_tau(tiny_checkpoint, tmp_path):
    spec = '{"method": "mtp", "num_speculative_tokens": 2}'
    args = sweep_args(tiny_checkpoint, tmp_path, "decode", "2", "--tag", "spec", "--speculative-config", spec)
    assert sweep.main(args) == 0
    (record,) = read_records(tmp_path / "spec" / "results.jsonl")
    measured = record["measured"]
    assert record["speculative"] == {
        "method": "mtp",
        "num_speculative_tokens": 2,
        "confidence_threshold": 0.0,
        "draft_token_map": None,
    }
    assert record["nextn"] == 2
    assert record["tokens_per_step"] == 2 * 3  # each sequence verifies its token and two drafts per step
    assert measured["drafts"] == 2 * 2 * record["steps"] and 0 <= measured["accepted"] <= measured["drafts"]
    assert measured["tau"] == pytest.approx(1 + measured["accepted"] / (2 * record["steps"]))
    assert measured["tokens_per_step_per_user"] == pytest.approx(measured["tau"])
    assert record["tokens_per_s_per_gpu"] == measured["tokens_per_s_per_gpu"]
    assert record["irregular_steps"] == 0 and record["assumed"]["tokens_per_step_per_user"] == 2.5


def test_decode_sweep_with_coin_acceptance_reports_the_coins_tau(tiny_checkpoint, tmp_path):
    """The benchmark device accepts each draft with the coin's probability: tau near 1 + K x rate, named as such."""
    spec = '{"method": "mtp", "num_speculative_tokens": 3}'
    args = sweep_args(tiny_checkpoint, tmp_path, "decode", "4", "--tag", "coin", "--speculative-config", spec,
                      "--coin-acceptance", "0.75", "--measure-steps", "12")  # fmt: skip
    assert sweep.main(args) == 0
    (record,) = read_records(tmp_path / "coin" / "results.jsonl")
    measured = record["measured"]
    assert "seeded coin at 0.75" in measured["basis"]
    assert measured["accepted"] / measured["drafts"] == pytest.approx(0.75, abs=0.12)
    assert measured["tau"] == pytest.approx(1 + 3 * 0.75, abs=0.4)
    with pytest.raises(ValueError, match="--coin-acceptance"):
        sweep_options.parse_args(["decode", "--coin-acceptance", "0.75"])


def test_speculative_config_is_checked_at_the_flag():
    with pytest.raises(ValueError, match="--speculative-config: speculative_config 'num_speculative_tokens'"):
        sweep_options.parse_args(["decode", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 9}'])
    with pytest.raises(ValueError, match="speculative decoding applies to decode sweeps only"):
        sweep_options.parse_args(["prefill", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}'])


def test_decode_point_with_profiled_steps(tiny_checkpoint, tmp_path, monkeypatch):
    """``--profile-steps``: steps profiled after the timed ones, their summary in the point's record (on the CPU the
    spans are the top-level torch ops), and the timed steps' records as without it. The session starts by recording
    the decode graphs again (``recapture_graphs``: CUPTI sees a graph's kernels only if it was instantiated while
    recording)."""
    from dsinfer.bench import sweep_points

    recaptured = []
    monkeypatch.setattr(sweep_points, "recapture_graphs", recaptured.append)
    assert sweep.main(sweep_args(tiny_checkpoint, tmp_path, "decode", "1", "--tag", "pf", "--profile-steps", "3")) == 0
    assert len(recaptured) == 1  # once, at the start of the session
    (record,) = read_records(tmp_path / "pf" / "results.jsonl")
    assert_consistent(record)
    profile = record["profile"]
    assert profile["steps"] == 3 and profile["kernels"] > 0 and profile["top"]
    assert profile["per_step"]["busy_ms"] == pytest.approx(profile["busy_ms"] / 3)
    assert 0 < profile["busy_ms"] and profile["idle_ms"] <= profile["span_ms"]


def test_prefill_point_with_profiled_steps(tiny_checkpoint, tmp_path):
    """A prefill sweep profiles its steps after the timed ones too. A batch of one whole prompt a step leaves no
    slack: the run must add a request for every profiled step, or the engine runs out of work while profiling."""
    argv = sweep_args(tiny_checkpoint, tmp_path, "prefill", str(CONTEXT), "--tag", "pp", "--profile-steps", "2")
    assert sweep.main(argv) == 0
    (record,) = read_records(tmp_path / "pp" / "results.jsonl")
    assert_consistent(record)
    assert record["profile"]["steps"] == 2 and record["profile"]["kernels"] > 0
    assert record["tokens_per_step"] == CONTEXT


def test_profiles_record_the_steps_of_a_worker_thread_started_before_them():
    """The engine's steps run on its device worker's thread, which exists before the profiler starts: a session
    must record that thread's ops too, not only the thread that started it."""
    from concurrent.futures import ThreadPoolExecutor

    from dsinfer.bench import step_profile

    x = torch.ones(8)
    with ThreadPoolExecutor(1) as worker:
        worker.submit(lambda: None).result()  # the thread exists before the session
        spans = step_profile.profiled_spans(lambda: worker.submit(torch.cumsum, x, 0).result(), torch.device("cpu"))
    assert "aten::cumsum" in {name for _, _, name in spans}


def test_graphs_are_recorded_again_on_the_device_worker():
    import threading
    from types import SimpleNamespace

    from dsinfer.engine.device_worker import DeviceWorker

    worker, threads = DeviceWorker(runner=None, sampler=None), []

    def graphs(kind: str) -> SimpleNamespace:
        return SimpleNamespace(recapture=lambda: threads.append((kind, threading.current_thread().name)))

    try:
        sweep_timing.recapture_graphs(
            SimpleNamespace(worker=worker, runner=SimpleNamespace(decode_graphs=graphs("decode")))
        )
        sweep_timing.recapture_graphs(SimpleNamespace(worker=worker, runner=SimpleNamespace(decode_graphs=None)))
        worker.speculative = SimpleNamespace(graphs=graphs("speculative"))  # an engine with drafts: both kinds
        sweep_timing.recapture_graphs(
            SimpleNamespace(worker=worker, runner=SimpleNamespace(decode_graphs=graphs("decode")))
        )
        worker.speculative = SimpleNamespace(graphs=None)  # drafts run eagerly: nothing of theirs to record
        sweep_timing.recapture_graphs(SimpleNamespace(worker=worker, runner=SimpleNamespace(decode_graphs=None)))
    finally:
        worker.close()
    assert [kind for kind, _ in threads] == ["decode", "decode", "speculative"]
    assert all(thread.startswith("dsinfer-device") for _, thread in threads)


def test_a_profile_leaves_out_what_its_preparation_ran():
    """A session's ``prepare`` (recording graphs again, on a GPU) runs inside the session, and its ops stay out of
    the steps' spans."""
    from dsinfer.bench import step_profile

    x = torch.ones(8)
    spans = step_profile.profiled_spans(
        lambda: torch.cumsum(x, 0), torch.device("cpu"), prepare=lambda: torch.cumprod(x, 0)
    )
    names = {name for _, _, name in spans}
    assert "aten::cumsum" in names and "aten::cumprod" not in names


def test_work_between_steps_runs_on_the_device_worker_after_the_queued_steps():
    import threading

    from dsinfer.engine.device_worker import DeviceWorker

    worker = DeviceWorker(runner=None, sampler=None)
    try:
        order, gate = [], threading.Event()
        worker._pool.submit(lambda: (gate.wait(5), order.append("step")))
        ran = []
        threading.Timer(0.1, gate.set).start()
        assert worker.run_between_steps(lambda: ran.append(threading.current_thread().name) or 7) == 7
        assert order == ["step"] and ran[0].startswith("dsinfer-device")
    finally:
        worker.close()


# ---- V4.1 in the sweep ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_v41_config(tmp_path_factory):
    """The tiny V4.1 architecture (every CSA2 role, two Engram layers) with Engram rows of the release's 256 FP8 bytes,
    the width the shared-memory store holds."""
    from dsinfer.models.tiny import tiny_config_v41

    config = tiny_config_v41(engram_head_dim=256, engram_vocab_size=200, engram_num_embeddings=())
    path = tmp_path_factory.mktemp("v41") / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    return path, config


def test_v41_sweep_runs_a_decode_and_a_prefill_point(tiny_v41_config, tmp_path, capsys):
    path, config = tiny_v41_config
    common = ["--config", str(path), "--arch", "v41", "--context", "48", "--device", "cpu", "--warmup-steps", "1",
              "--measure-steps", "2", "--out-root", str(tmp_path), "--compare-published"]  # fmt: skip
    assert sweep.main(["decode", "--points", "2", "--tag", "d41", *common]) == 0
    assert sweep.main(["prefill", "--points", "32", "--tag", "p41", "--v41-prefill", "exact", *common]) == 0
    (decode,) = read_records(tmp_path / "d41" / "results.jsonl")
    (prefill,) = read_records(tmp_path / "p41" / "results.jsonl")
    for record in (decode, prefill):
        assert_consistent(record)
        assert record["arch"] == "v41" and record["num_layers"] == 9 and record["weights"] == "random (native)"
        table_bytes = sum(config.engram_num_embeddings) * (256 + 8)  # FP8 rows and their ue8m0 scales
        assert record["engram_table_gib"] == pytest.approx(table_bytes / 2**30)
        assert record["cache"]["storage"] == "fp8" and record["cache"]["bytes_per_sequence"] > 0
        assert record["full_depth"]["release_layers"] == 40
    assert decode["tokens_per_step"] == 2 and decode["fill_budget"] == 8192
    assert decode["v41_prefill"] == "bounded" and decode["engine"]["v41_prefill"] == "bounded"
    assert prefill["tokens_per_step"] == 32 and prefill["engine"]["v41_prefill"] == "exact"
    out = capsys.readouterr().out
    assert "ratio-2 KV source" in out and "Engram history" in out and "sequences of" in out
    assert_png(tmp_path / "d41" / "pareto.png")


def test_v41_arch_needs_a_v41_shape(tmp_path, capsys):
    assert sweep.main(["decode", "--arch", "v41", "--device", "cpu", "--out-root", str(tmp_path)]) == 2
    assert "--arch v41" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--v41-prefill bounded"):
        sweep_options.parse_args(["decode", "--v41-prefill", "bounded", "--speculative-config",
                                  '{"method": "dspark", "num_speculative_tokens": 2}'])  # fmt: skip


# ---- the cache per layer kind, by hand -----------------------------------------------------------------------------
def test_v4_cache_per_kind_by_hand():
    """V4-Flash widths (head 512, indexer keys 128, window 128), 1,000 tokens in 128-token blocks: 1,024 positions."""
    from dsinfer.bench.shapes import flash_slice_config
    from dsinfer.kv.cache_v4 import KVCache
    from dsinfer.kv.codecs import INDEX_KEY_FP8_FORMAT
    from dsinfer.kv.sequence_bytes import sequence_bytes, v4_kind_bytes, v4_storages

    config = flash_slice_config(3)  # window, CSA (ratio 4), HCA (ratio 128)
    storages = v4_storages()
    bf16 = {kind.kind: kind.per_layer for kind in v4_kind_bytes(config, 1000, 128, storages["bf16"])}
    assert bf16 == {
        "window": 128 * 512 * 2,
        # ring + 4 x 4 x (2 x 512 + 2 x 128) bf16 compressor state + 256 entries of 512 KV and 128 key channels
        "CSA (ratio 4)": 131072 + 40960 + 256 * 640 * 2,
        "HCA (ratio 128)": 131072 + 2 * 128 * 512 * 2 + 8 * 512 * 2,
    }
    fp8 = {kind.kind: kind.per_layer for kind in v4_kind_bytes(config, 1000, 128, storages["fp8"])}
    key = 128 + 1  # the indexer keys only: e4m3 codes and one ue8m0 byte per 128 channels
    assert fp8 == {**bf16, "CSA (ratio 4)": 131072 + 40960 + 256 * (512 * 2 + key)}
    for name, index_keys in (("bf16", None), ("fp8", INDEX_KEY_FP8_FORMAT)):  # the engine's count agrees
        cache = KVCache(config, list(config.compress_ratios), 1, 8, 128, torch.bfloat16, "meta", index_keys)
        expected = cache.slot_bytes() + 8 * cache.block_bytes()
        assert sequence_bytes(v4_kind_bytes(config, 1000, 128, storages[name])) == expected


def test_v41_cache_per_kind_by_hand():
    """The 4-layer V4.1 slice (window + Engram, ratio-2 source, ratio-1 source, keyless index source), 1,000 tokens
    in 64-token blocks: 1,024 positions."""
    from dsinfer.bench.cache_budget import refusal
    from dsinfer.bench.v41_slice import v41_slice_config
    from dsinfer.kv.cache_v41 import KVCacheV41
    from dsinfer.kv.sequence_bytes import sequence_bytes, v41_kind_bytes, v41_storages

    config, storages = v41_slice_config(4, experts=8), v41_storages()
    bf16 = {kind.kind: kind.per_layer for kind in v41_kind_bytes(config, 1000, 64, storages["bf16"])}
    assert bf16 == {
        "window": 131072,
        "ratio-2 KV source": 131072 + 2 * 2 * 512 * 4 + 512 * (512 + 128) * 2,  # fp32 pending group, 512 entries
        "ratio-1 KV source": 131072 + 1024 * (512 + 128) * 2,
        "ratio-1 keyless index source": 131072,
        "Engram history": 3 * 8,
    }
    fp8 = {kind.kind: kind.per_layer for kind in v41_kind_bytes(config, 1000, 64, storages["fp8"])}
    window, entry = 128 * (512 + 16), (256 + 32) + (64 + 4)  # FP8 ring; FP4 entries (e4m3 / 16), FP4 keys (ue8m0 / 32)
    assert fp8 == {"window": window, "ratio-2 KV source": window + 8192 + 512 * entry,
                   "ratio-1 KV source": window + 1024 * entry, "ratio-1 keyless index source": window,
                   "Engram history": 24}  # fmt: skip
    for name, quantized in (("bf16", False), ("fp8", True)):  # the engine's own count agrees
        cache = KVCacheV41(config, 1, 16, 64, torch.bfloat16, "meta", quantized_storage=quantized)
        expected = cache.slot_bytes() + 16 * cache.block_bytes()
        assert sequence_bytes(v41_kind_bytes(config, 1000, 64, storages[name])) == expected
    per_sequence = sequence_bytes(v41_kind_bytes(config, 1000, 64, storages["fp8"]))
    assert refusal(3, 1000, per_sequence, (3 * per_sequence + 1, "test")) is None
    message = refusal(4, 1000, per_sequence, (3 * per_sequence + 1, "test"))
    assert "4 sequences of 1,000 tokens" in message and "at most 3 fit" in message and "--cache-gib" in message


def test_a_point_that_cannot_fit_is_refused_with_one_message(tiny_checkpoint, tmp_path, capsys):
    args = sweep_args(tiny_checkpoint, tmp_path, "decode", "1,64", "--tag", "fit", "--cache-gib", "0.0005")
    assert sweep.main(args) == 0  # the point that fits runs
    summary = json.loads((tmp_path / "fit" / "summary.json").read_text())
    assert summary["points"] == [1] and [s["point"] for s in summary["skipped"]] == [64]
    assert "64 sequences of" in summary["skipped"][0]["reason"] and "fit" in summary["skipped"][0]["reason"]
    assert "decode point     64: skipped, 64 sequences" in capsys.readouterr().err


# ---- the fill budget, the full-depth estimate and DeepInfer's points -----------------------------------------------
def test_the_fill_takes_the_fastest_budget_that_runs():
    from dsinfer.bench.sweep_points import PointSkipped, fastest_fill_budget

    rates = {8192: 90_000.0, 16384: 120_000.0, 32768: PointSkipped("64 sequences ... at most 3 fit")}

    def probe(budget):
        if isinstance(rates[budget], Exception):
            raise rates[budget]
        return rates[budget]

    best, results = fastest_fill_budget([8192, 16384, 32768], probe)
    assert best == 16384 and results[8192] == 90_000.0 and results[32768].startswith("not run: 64 sequences")
    with pytest.raises(PointSkipped, match="no fill budget"):
        fastest_fill_budget([32768], probe)


def test_the_fill_probes_only_budgets_a_prompt_needs_two_steps_of():
    from types import SimpleNamespace

    from dsinfer.bench.sweep_points import fill_budget, probed_fill_candidates

    assert probed_fill_candidates(131072) == [8192, 16384, 32768]
    assert probed_fill_candidates(32768) == [8192, 16384]
    assert probed_fill_candidates(16384) == [8192]
    assert probed_fill_candidates(256) == []
    # A short context on CUDA takes the smallest budget without a probe (a probe's second step would find no work).
    bench = SimpleNamespace(fill_budget=None, args=SimpleNamespace(prefill_chunk=None, context=256),
                            device=torch.device("cuda"), info={})  # fmt: skip
    assert fill_budget(bench) == 8192 and "fill_budget_probe" not in bench.info


def test_full_depth_estimate_arithmetic():
    from dsinfer.bench.published import full_depth_estimate, record_estimate

    decode = full_depth_estimate(10.0, 4, 40, 2.0, 3.25, 64)  # 2 ms a layer x 40 + 2 ms of head
    assert decode["per_layer_ms"] == pytest.approx(2.0) and decode["ms_per_step"] == pytest.approx(82.0)
    assert decode["tokens_per_s_per_user"] == pytest.approx(3.25 / 0.082)
    assert decode["tokens_per_s_per_gpu"] == pytest.approx(64 * 3.25 / 0.082)
    prefill = full_depth_estimate(100.0, 4, 43, 0.5, None, 8192)
    assert prefill["ms_per_step"] == pytest.approx(99.5 / 4 * 43 + 0.5)
    assert prefill["tokens_per_s_per_gpu"] == pytest.approx(8192 / (prefill["ms_per_step"] / 1e3))
    record = {"mode": "decode", "point": 8, "arch": "v4", "num_layers": 4, "ms_per_step": 6.0, "nextn": 3,
              "assumed": {"tokens_per_step_per_user": 3.25}, "measured": {"tokens_per_step_per_user": 1.0}}  # fmt: skip
    estimate = record_estimate(record, 1.0)  # V4-Flash: 43 layers; DeepInfer's chart's accounting (tau 3.25)
    assert estimate["ms_per_step"] == pytest.approx(5.0 / 4 * 43 + 1.0)
    assert estimate["tokens_per_s_per_user"] == pytest.approx(3.25 / (estimate["ms_per_step"] / 1e3))


def test_chart_overlays_published_points_and_the_estimate(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from dsinfer.bench.published import PUBLISHED_B200, comparison_lines, full_depth_estimate

    records = []
    for point, ms in ((8, 3.0), (64, 6.0), (256, 15.0)):
        estimate = full_depth_estimate(ms, 4, 40, 0.5, 3.25, point)
        records.append({"mode": "decode", "point": point, "context": 131072, "nextn": 3, "accept": 0.75,
                        "tokens_per_s_per_user": 1e3 / ms, "tokens_per_s_per_gpu": point * 1e3 / ms,
                        "assumed": {"tokens_per_step_per_user": 3.25, "tokens_per_s_per_user": 3250 / ms,
                                    "tokens_per_s_per_gpu": point * 3250 / ms}, "full_depth": estimate})  # fmt: skip
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    pareto.draw_pareto(records, tmp_path / "chart.png", compare_published=True)
    lines = {line.get_label(): line for line in figures[0].axes[0].get_lines()}
    estimate_line = next(line for label, line in lines.items() if label.startswith("full-depth estimate"))
    assert list(estimate_line.get_ydata()) == [r["full_depth"]["tokens_per_s_per_gpu"] for r in records]
    published_line = next(line for label, line in lines.items() if label.startswith("DeepInfer README"))
    assert list(published_line.get_ydata()) == [row[2] for row in PUBLISHED_B200["decode"]]
    text = comparison_lines(records)
    assert "DeepInfer      2600 tok/s/GPU" in text[1] and "DeepInfer     26000 tok/s/GPU" in text[3]
    assert f"{records[1]['full_depth']['ms_per_step']:8.2f} ms/step" in text[2]


def test_decode_fill_forks_the_sequences_past_fill_prompts(tiny_v41_config, tmp_path):
    path, _ = tiny_v41_config
    argv = ["decode", "--config", str(path), "--arch", "v41", "--context", "48", "--device", "cpu", "--points", "3",
            "--fill-prompts", "1", "--warmup-steps", "1", "--measure-steps", "2", "--out-root", str(tmp_path),
            "--tag", "fork"]  # fmt: skip
    assert sweep.main(argv) == 0
    (record,) = read_records(tmp_path / "fork" / "results.jsonl")
    assert_consistent(record)
    assert record["fill_prompts"] == 1 and record["fill_forks"] == 2 and record["tokens_per_step"] == 3
    assert record["context_range"][0] > 48 and record["preemptions"] == 0
