"""GPU telemetry: a no-op with one clear message without NVML, real CSV rows through an NVML stand-in, summarize()."""

from __future__ import annotations

import csv
import json
import sys
import time
import types
from types import SimpleNamespace

import pytest

from dsinfer.bench.telemetry import COLUMNS, TelemetrySampler, summarize
from dsinfer.bench.telemetry import main as telemetry_main


class FakeNVMLError(Exception):
    pass


def fake_nvml(num_gpus: int = 2, init_error: bool = False) -> types.ModuleType:
    """The slice of the pynvml API the sampler calls; GPU i reports values derived from i."""
    module = types.ModuleType("pynvml")
    module.NVMLError = FakeNVMLError
    module.NVML_CLOCK_SM = 1
    module.NVML_TEMPERATURE_GPU = 0
    module.shutdowns = 0

    def init():
        if init_error:
            raise FakeNVMLError("Driver Not Loaded")

    def shutdown():
        module.shutdowns += 1

    def unsupported(*args):
        raise FakeNVMLError("Not Supported")

    module.nvmlInit = init
    module.nvmlShutdown = shutdown
    module.nvmlDeviceGetCount = lambda: num_gpus
    module.nvmlDeviceGetHandleByIndex = lambda i: i
    module.nvmlDeviceGetName = lambda h: b"Fake H200"
    module.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=50 + h, memory=20 + h)
    module.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(used=(1000 + h) * 2**20)
    module.nvmlDeviceGetPowerUsage = lambda h: 300_000 + 1000 * h  # milliwatts
    module.nvmlDeviceGetClockInfo = lambda h, kind: 1980 if kind == module.NVML_CLOCK_SM else -1
    module.nvmlDeviceGetTemperature = unsupported
    module.nvmlDeviceGetHandleByUUID = lambda uuid: int(uuid.removeprefix("GPU-fake-"))
    module.nvmlDeviceGetIndex = lambda h: h
    return module


def read_rows(path):
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def test_without_nvml_driver_it_says_so_once_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(init_error=True))
    path = tmp_path / "telemetry.csv"
    with TelemetrySampler(path, interval_s=0.01) as sampler:
        time.sleep(0.05)
    err = capsys.readouterr().err
    assert err.count("telemetry: off") == 1
    assert "NVML is not available" in err and "Driver Not Loaded" in err and "no telemetry.csv written" in err
    assert sampler.off_reason is not None and not sampler.active
    assert not path.exists()


def test_without_the_package_it_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    path = tmp_path / "telemetry.csv"
    sampler = TelemetrySampler(path)
    assert sampler.start() is False
    sampler.stop()  # safe when off
    assert "nvidia-ml-py" in capsys.readouterr().err
    assert not path.exists()


def test_no_visible_gpu_is_a_no_op(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(num_gpus=0))
    assert TelemetrySampler(tmp_path / "t.csv").start() is False
    assert "no GPU is visible" in capsys.readouterr().err
    assert not (tmp_path / "t.csv").exists()


def test_samples_every_visible_gpu_into_csv(tmp_path, monkeypatch):
    nvml = fake_nvml(num_gpus=2)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "telemetry.csv"
    with TelemetrySampler(path, interval_s=0.02):
        time.sleep(0.15)
    rows = read_rows(path)
    assert tuple(rows[0].keys()) == COLUMNS
    gpus = [int(r["gpu"]) for r in rows]
    assert gpus.count(0) == gpus.count(1) >= 3  # start, a few intervals, stop
    first = next(r for r in rows if r["gpu"] == "1")
    assert first["name"] == "Fake H200"
    assert float(first["power_w"]) == pytest.approx(301.0)
    assert float(first["memory_used_mib"]) == 1001
    assert first["sm_clock_mhz"] == "1980" and first["gpu_util_percent"] == "51"
    assert first["temperature_c"] == ""  # unsupported reading: empty cell, not a crash
    assert nvml.shutdowns == 1


def test_held_takes_no_sample_inside_the_block(tmp_path, monkeypatch):
    """Held for a block of many intervals, the sampler reads NVML only outside it (start, after it, stop)."""
    nvml = fake_nvml(num_gpus=1)
    reads = []
    power = nvml.nvmlDeviceGetPowerUsage
    nvml.nvmlDeviceGetPowerUsage = lambda h: reads.append(time.monotonic()) or power(h)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with TelemetrySampler(tmp_path / "t.csv", interval_s=0.01) as sampler:
        with sampler.held():
            start = time.monotonic()
            time.sleep(0.2)
            end = time.monotonic()
        time.sleep(0.1)
    assert not [t for t in reads if start <= t <= end]
    assert len([t for t in reads if t > end]) >= 2  # sampling resumed after the block, then the stop's


def test_cuda_visible_devices_picks_the_boards(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(num_gpus=4))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-fake-3,2")
    path = tmp_path / "telemetry.csv"
    with TelemetrySampler(path, interval_s=10, devices=[1]):  # cuda:1 is NVML board 2
        pass
    assert {r["gpu"] for r in read_rows(path)} == {"2"}


def test_summarize_means_and_maxima(tmp_path):
    path = tmp_path / "telemetry.csv"
    path.write_text(
        ",".join(COLUMNS) + "\n"
        "2026-11-29T10:00:00+00:00,0.0,0,H200,10,5,100.0,1000,2000,\n"
        "2026-11-29T10:00:05+00:00,5.0,0,H200,30,,300.0,2000,4000,60\n"
        "2026-11-29T10:00:10+00:00,10.0,1,H200,50,15,200.0,1500,3000,70\n"
    )
    summary = summarize(path)
    assert summary["samples"] == 3 and summary["gpus"] == [0, 1] and summary["duration_s"] == 10.0
    columns = summary["columns"]
    assert columns["gpu_util_percent"] == {"mean": 30.0, "max": 50.0}
    assert columns["power_w"] == {"mean": 200.0, "max": 300.0}
    assert columns["sm_clock_mhz"] == {"mean": 1500.0, "max": 2000.0}
    assert columns["memory_used_mib"] == {"mean": 3000.0, "max": 4000.0}
    assert columns["memory_util_percent"] == {"mean": 10.0, "max": 15.0}  # the empty cell is skipped
    assert columns["temperature_c"] == {"mean": 65.0, "max": 70.0}
    assert "gpu" not in columns and "elapsed_s" not in columns and "name" not in columns


def test_summarize_rejects_a_non_number(tmp_path):
    path = tmp_path / "telemetry.csv"
    path.write_text(",".join(COLUMNS) + "\nt,0.0,0,H200,ten,5,100,1000,2000,50\n")
    with pytest.raises(ValueError, match="gpu_util_percent"):
        summarize(path)


def test_summarize_of_a_header_only_file(tmp_path):
    path = tmp_path / "telemetry.csv"
    path.write_text(",".join(COLUMNS) + "\n")
    assert summarize(path) == {"samples": 0, "gpus": [], "duration_s": 0.0, "columns": {}}


def test_command_line_samples_while_a_command_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(num_gpus=1))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "telemetry.csv"
    command = [sys.executable, "-c", "import time, sys; time.sleep(0.2); sys.exit(3)"]
    assert telemetry_main([str(path), "--interval", "0.05", "--", *command]) == 3  # the command's status
    summary = json.loads(capsys.readouterr().out)
    assert summary["samples"] == len(read_rows(path)) >= 3
    assert summary["columns"]["power_w"] == {"mean": 300.0, "max": 300.0}


def test_summarize_inside_a_window_keeps_only_its_rows(tmp_path):
    """A sweep point's utilisation: the rows sampled while its timed steps ran, by the elapsed_s column."""
    path = tmp_path / "telemetry.csv"
    path.write_text(
        ",".join(COLUMNS) + "\n"
        "2026-11-29T10:00:00+00:00,0.5,0,H200,5,5,100.0,1000,2000,50\n"
        "2026-11-29T10:00:01+00:00,1.5,0,H200,96,5,500.0,1980,2000,50\n"
        "2026-11-29T10:00:02+00:00,2.5,0,H200,98,5,550.0,1980,2000,50\n"
        "2026-11-29T10:00:03+00:00,3.5,0,H200,0,5,90.0,1000,2000,50\n"
    )
    inside = summarize(path, (1.0, 3.0))
    assert inside["samples"] == 2 and inside["columns"]["gpu_util_percent"] == {"mean": 97.0, "max": 98.0}
    assert summarize(path, (4.0, 5.0))["samples"] == 0
    assert summarize(path)["columns"]["gpu_util_percent"]["mean"] == 49.75


def test_summarize_leaves_out_rows_whose_reading_reaches_back_before_the_window(tmp_path):
    """NVML's utilisation is the busy share of the period before a reading: the row taken 0.1 s into a window
    sampled every 0.25 s describes mostly the idle time before the window opened."""
    path = tmp_path / "telemetry.csv"
    path.write_text(
        ",".join(COLUMNS) + "\n"
        "2026-11-29T10:00:00+00:00,1.10,0,H200,17,5,200.0,1980,2000,50\n"
        "2026-11-29T10:00:00+00:00,1.35,0,H200,100,5,600.0,1980,2000,50\n"
        "2026-11-29T10:00:00+00:00,1.60,0,H200,100,5,650.0,1980,2000,50\n"
    )
    assert summarize(path, (1.0, 2.0))["columns"]["gpu_util_percent"]["mean"] == 72.33333333333333
    steady = summarize(path, (1.0, 2.0), lookback_s=0.25)
    assert steady["samples"] == 2 and steady["columns"]["gpu_util_percent"] == {"mean": 100.0, "max": 100.0}
