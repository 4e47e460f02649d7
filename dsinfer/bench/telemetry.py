"""GPU telemetry while a sweep or an eval runs: utilisation, power, SM clock and memory, sampled through NVML.

Seed 000 sampled GPU utilisation, power and SM clock every 5 s during its runs; a throughput number means
more beside them (a throttled clock or a half-idle GPU explains a slow point). The sampler is a background
thread that reads NVML (the ``nvidia-ml-py`` package, imported as ``pynvml``) every ``interval_s`` seconds
and appends one CSV row per GPU, flushed at once, so a run that dies still leaves its samples:

    time_utc,elapsed_s,gpu,name,gpu_util_percent,memory_util_percent,power_w,sm_clock_mhz,memory_used_mib,temperature_c

``gpu`` is the NVML index; ``name`` the board name. A reading the board does not support is left empty.
One sample is taken at start and one at stop, so even a short run has two rows per GPU.

Reading NVML is not free for the process being measured: on the H200, a one-request decode step that met a
sample took several times the median step, and none did with the sampler off (docs/perf.md, history, pass 13).
:meth:`TelemetrySampler.held` skips the samples due while a block runs (the sweep's decode steps, each too short
for a reading to describe).

Without NVML (no driver, no GPU, ``pynvml`` not installed) the sampler prints one line saying telemetry is
off and why, writes no file, and the run goes on: telemetry never stops a benchmark.

    python -m dsinfer.bench.telemetry OUT.csv [--interval 5] -- COMMAND [ARGS...]

runs COMMAND while sampling and prints :func:`summarize` (mean / max per column) as JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

COLUMNS = (
    "time_utc",
    "elapsed_s",
    "gpu",
    "name",
    "gpu_util_percent",
    "memory_util_percent",
    "power_w",
    "sm_clock_mhz",
    "memory_used_mib",
    "temperature_c",
)
# Columns that identify a row rather than measure something; summarize() leaves them out.
_ID_COLUMNS = ("time_utc", "elapsed_s", "gpu", "name")


def visible_gpu_indices(nvml: Any) -> list[int]:
    """NVML indices of the GPUs this process may use: CUDA_VISIBLE_DEVICES (indices or UUIDs), else all.

    NVML numbers every board on the host and ignores CUDA_VISIBLE_DEVICES, so the mapping is done here;
    entry i of the result is the board torch calls ``cuda:i``.
    """
    count = nvml.nvmlDeviceGetCount()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return list(range(count))
    indices = []
    for entry in (part.strip() for part in listed.split(",")):
        if not entry:
            continue
        if entry.isdigit():
            index = int(entry)
        else:  # a UUID ("GPU-..."): CUDA stops at the first entry it cannot resolve, and so do we
            try:
                index = nvml.nvmlDeviceGetIndex(nvml.nvmlDeviceGetHandleByUUID(entry))
            except nvml.NVMLError:
                break
        if not 0 <= index < count:
            break
        indices.append(index)
    return indices


class TelemetrySampler:
    """Sample NVML in a background thread into ``path`` (CSV); a no-op with one message when NVML is absent.

    ``devices`` picks boards by their CUDA index as this process sees them (``cuda:0`` is 0); None samples
    every visible board. Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, path: str | Path, interval_s: float = 5.0, devices: list[int] | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"telemetry interval must be positive, got {interval_s}")
        self.path = Path(path)
        self.interval_s = interval_s
        self.devices = devices
        self.active = False
        self.off_reason: str | None = None
        self._nvml: Any = None
        self._handles: list[tuple[int, Any, str]] = []
        self._stop = threading.Event()
        self._held = threading.Event()
        self._sampling = threading.Lock()  # held by the thread while it reads NVML
        self._thread: threading.Thread | None = None
        self._file = None
        self._writer = None
        self._started_at = 0.0

    @property
    def started_at(self) -> float:
        """``time.monotonic()`` when sampling started: the zero of the ``elapsed_s`` column."""
        return self._started_at

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> bool:
        """Open NVML and begin sampling; returns False (after printing why) when there is nothing to sample."""
        reason = self._open_nvml()
        if reason is not None:
            self.off_reason = reason
            print(f"telemetry: off, {reason}; no {self.path.name} written", file=sys.stderr)
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w", newline="")
        self._writer = csv.writer(self._file, lineterminator="\n")
        self._writer.writerow(COLUMNS)
        self._started_at = time.monotonic()
        self.active = True
        self._sample()
        self._thread = threading.Thread(target=self._run, name="gpu-telemetry", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """Take a last sample, stop the thread, close the file and NVML. Safe to call twice or when off."""
        if not self.active:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        self._file.close()
        self.active = False
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass

    def __enter__(self) -> TelemetrySampler:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # ---- internals ---------------------------------------------------------------------------
    def _open_nvml(self) -> str | None:
        """Initialise NVML and resolve the boards; the reason telemetry is off, or None when it is on."""
        try:
            import pynvml
        except ImportError:
            return "the nvidia-ml-py package (pynvml) is not installed"
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return f"NVML is not available ({exc}): no NVIDIA driver or GPU"
        try:
            visible = visible_gpu_indices(pynvml)
            chosen = visible if self.devices is None else [visible[i] for i in self.devices if 0 <= i < len(visible)]
            handles = []
            for index in chosen:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                name = pynvml.nvmlDeviceGetName(handle)
                handles.append((index, handle, name.decode() if isinstance(name, bytes) else str(name)))
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            return f"NVML could not list the GPUs ({exc})"
        if not handles:
            pynvml.nvmlShutdown()
            return "no GPU is visible to this process"
        self._nvml, self._handles = pynvml, handles
        return None

    @contextmanager
    def held(self) -> Iterator[None]:
        """No samples while the block runs (one under way finishes first); sampling resumes after it."""
        self._held.set()
        with self._sampling:  # a sample under way finishes before the block starts
            pass
        try:
            yield
        finally:
            self._held.clear()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._sampling:
                if not self._held.is_set():
                    self._sample()

    def _sample(self) -> None:
        nvml = self._nvml
        now = datetime.now(UTC).isoformat(timespec="seconds")
        elapsed = f"{time.monotonic() - self._started_at:.3f}"
        for index, handle, name in self._handles:
            utilization = self._read(nvml.nvmlDeviceGetUtilizationRates, handle)
            memory = self._read(nvml.nvmlDeviceGetMemoryInfo, handle)
            power_mw = self._read(nvml.nvmlDeviceGetPowerUsage, handle)
            clock = self._read(lambda h: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM), handle)
            temperature = self._read(lambda h: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU), handle)
            self._writer.writerow(
                [
                    now,
                    elapsed,
                    index,
                    name,
                    "" if utilization is None else utilization.gpu,
                    "" if utilization is None else utilization.memory,
                    "" if power_mw is None else f"{power_mw / 1000:.1f}",
                    "" if clock is None else clock,
                    "" if memory is None else f"{memory.used / 2**20:.0f}",
                    "" if temperature is None else temperature,
                ]
            )
        self._file.flush()

    def _read(self, query, handle):
        """One NVML reading, or None where the board does not support it (a cell left empty)."""
        try:
            return query(handle)
        except self._nvml.NVMLError:
            return None


def summarize(path: str | Path, window: tuple[float, float] | None = None, lookback_s: float = 0.0) -> dict[str, Any]:
    """Mean and max of every measured column of a telemetry CSV, over all rows (all GPUs together).

    ``window`` (seconds since the sampler started, the ``elapsed_s`` column): only the rows sampled inside it,
    e.g. a sweep point's timed steps. ``lookback_s``: how far back a row's reading reaches. NVML's utilisation is
    the busy share of the sample period before the reading, so a row taken just after the window opened still
    describes the time before it; with ``lookback_s`` (the sampling interval) only rows whose whole look-back lies
    inside the window count. Returns ``{"samples": rows, "gpus": [indices], "duration_s": last elapsed,
    "columns": {column: {"mean": x, "max": y}}}``; empty cells are skipped, a column with none left out.
    """
    path = Path(path)
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    if window is not None:
        rows = [row for row in rows if window[0] + lookback_s <= float(row["elapsed_s"] or "nan") <= window[1]]
    columns: dict[str, dict[str, float]] = {}
    fieldnames = [name for name in (rows[0].keys() if rows else ()) if name not in _ID_COLUMNS]
    for name in fieldnames:
        values = []
        for row in rows:
            cell = (row.get(name) or "").strip()
            if not cell:
                continue
            try:
                values.append(float(cell))
            except ValueError:
                raise ValueError(f"{path}: column {name!r} holds a non-number {cell!r}") from None
        if values:
            columns[name] = {"mean": sum(values) / len(values), "max": max(values)}
    gpus = sorted({int(row["gpu"]) for row in rows if (row.get("gpu") or "").strip().isdigit()})
    elapsed = [float(row["elapsed_s"]) for row in rows if (row.get("elapsed_s") or "").strip()]
    return {"samples": len(rows), "gpus": gpus, "duration_s": max(elapsed, default=0.0), "columns": columns}


def main(argv: list[str] | None = None) -> int:
    """Run a command while sampling; print the summary (JSON) when it ends. Returns the command's status."""
    parser = argparse.ArgumentParser(
        prog="python -m dsinfer.bench.telemetry",
        usage="%(prog)s OUT.csv [--interval S] -- COMMAND [ARGS...]",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument("out", type=Path, help="CSV file to write")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples (default 5)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        parser.error("give the command to run after '--'")
    split = argv.index("--")
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]
    if not command:
        parser.error("give the command to run after '--'")
    if not args.interval > 0:
        parser.error(f"--interval must be positive, got {args.interval}")
    with TelemetrySampler(args.out, args.interval) as sampler:
        status = subprocess.call(command)
    if sampler.off_reason is None:
        print(json.dumps(summarize(args.out), indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
