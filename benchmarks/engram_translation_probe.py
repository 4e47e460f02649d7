"""Why scattered GPU reads of host memory are slow, and which host memory the GPU reads fastest.

    PYTHONPATH=$PWD python benchmarks/engram_translation_probe.py --out results/ [--table-gib 64]
        [--suite backings|records] [--backings registered vmm hostalloc vmm_min registered_2m]
        [--huge-pages 33000] [--cpu-lanes 16] [--shares 0.4 0.5 0.6] [--deadline-s 500]

Results go to ``--out`` as ``engram_translation_probe.json`` and ``.md``.

For each way of giving the GPU a table of ``--table-gib`` in host memory (one at a time):

* ``registered``: an anonymous mapping pinned with ``cudaHostRegister`` (how the ``host``
  placement maps the shared-memory segment today);
* ``hostalloc``: ``cuMemHostAlloc`` (the driver allocates and maps the pages itself);
* ``vmm``: ``cuMemCreate`` on a host NUMA node at the recommended granularity
  (:class:`vmm_host_memory.VmmHostMemory`); ``vmm_min`` at the minimum granularity;

it measures the Triton zero-copy gather (sorted unique random rows, 65,536 to 524,288, with a few
grid sizes), a footprint sweep (262,144 rows confined to the first W bytes), rows at a fixed
stride read by the gather and by the copy engine (``cuMemcpy2DAsync``), each as GB/s of row bytes
against the pinned host-to-device copy measured in the same run. Rows gathered from every backing
are checked against a CPU read.

``--suite records`` reads the same host memory as two tables (codes, then scales) and as 264-byte
records (each row's scales after its codes, the store's layout) with the zero-copy kernel and with
CPU threads (``numpy.take``), and runs a split of the two (``--shares``); ``registered_2m`` takes
2 MiB pages from ``--huge-pages`` reserved ones (root).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from engram_fetch import (
    GIB,
    ROW_BYTES,
    SCALE_BYTES,
    Report,
    configure_huge_pages,
    fenced,
    release_huge_pages,
    section,
    system_report,
    time_ms,
)
from vmm_host_memory import VmmHostMemory, cuda_driver

from dsinfer.engram.fetch import HostRegistration, host_tensor
from dsinfer.kernels.engram_gather import GatherLaunch, gather_dequantize, gather_dequantize_reference

ROWS_PER_STEP = (65_536, 262_144, 524_288)
FOOTPRINTS_MIB = (64, 1024, 8192, None)  # None: the whole table


class _Memcpy2D(ctypes.Structure):
    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


_UNIFIED = 4
_MAP_HUGETLB = 0x40000  # Linux; 2 MiB pages from the reserved pool


def _check(name: str, code: int) -> None:
    if code != 0:
        raise RuntimeError(f"{name} returned CUDA driver error {code}")


def copy_engine_strided(src: int, pitch: int, dst: torch.Tensor, rows: int) -> None:
    """``rows`` rows of ROW_BYTES at ``pitch`` apart from ``src`` into ``dst`` by one 2-D copy."""
    params = _Memcpy2D()
    params.srcMemoryType, params.srcDevice, params.srcPitch = _UNIFIED, src, pitch
    params.dstMemoryType, params.dstDevice, params.dstPitch = _UNIFIED, dst.data_ptr(), ROW_BYTES
    params.WidthInBytes, params.Height = ROW_BYTES, rows
    lib = cuda_driver().lib
    _check("cuMemcpy2DAsync_v2", lib.cuMemcpy2DAsync_v2(ctypes.byref(params), ctypes.c_void_p(_stream())))


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


# ------------------------------------------------------------------------------------------ backings
class Backing:
    """``nbytes`` of host memory the GPU can read at ``address``, released by ``close``."""

    def __init__(self, kind: str, nbytes: int, device: int):
        self.kind, self.nbytes = kind, nbytes
        self._close = []
        started = time.monotonic()
        if kind in ("registered", "registered_2m"):
            huge = _MAP_HUGETLB if kind == "registered_2m" else 0
            self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | huge)
            self._anchor = ctypes.c_char.from_buffer(self._map)
            self.address = ctypes.addressof(self._anchor)
            registration = HostRegistration(self.address, nbytes, f"cuda:{device}")
            self._close = [registration.close, self._release_map]
        elif kind == "hostalloc":
            lib = cuda_driver().lib
            pointer = ctypes.c_void_p()
            lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
            _check("cuMemHostAlloc", lib.cuMemHostAlloc(ctypes.byref(pointer), nbytes, 0x01 | 0x02))
            self.address = pointer.value
            lib.cuMemFreeHost.argtypes = [ctypes.c_void_p]
            self._close = [lambda: lib.cuMemFreeHost(ctypes.c_void_p(self.address))]
        elif kind in ("vmm", "vmm_min"):
            granularity = "recommended" if kind == "vmm" else "minimum"
            try:
                memory = VmmHostMemory(nbytes, device, granularity=granularity)
            except RuntimeError as exc:  # no NUMA-node allocations here: ask for host memory anywhere
                print(f"host_numa allocation failed ({exc}); trying location=host", flush=True)
                memory = VmmHostMemory(nbytes, device, granularity=granularity, location="host")
            self.granularity = memory.granularity
            self.address = memory.address
            self._close = [memory.close]
        else:
            raise ValueError(kind)
        self.setup_s = time.monotonic() - started

    def _release_map(self) -> None:
        del self._anchor
        self._map.close()

    def cpu_view(self, offset: int, nbytes: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(self.address + offset))

    def close(self) -> None:
        for close in self._close:
            close()


# ------------------------------------------------------------------------------------------ measurements
ID_SETS = 10
"""Fresh ids for every timed repetition: reading the same rows again finds their translations cached."""
MAX_REPS = ID_SETS - 4  # time_ms runs 2 warm-ups and 1 estimate first


def sorted_unique(count: int, high: int, generator: torch.Generator, device) -> torch.Tensor:
    ids = torch.randint(0, high, (count + count // 8,), generator=generator, device=device).unique(sorted=True)
    return ids[torch.randperm(ids.numel(), generator=generator, device=device)[:count]].sort().values


def id_sets(count: int, high: int, generator: torch.Generator, device) -> list[torch.Tensor]:
    """``ID_SETS`` independent sets of ``count`` sorted unique ids below ``high``."""
    return [sorted_unique(count, high, generator, device) for _ in range(ID_SETS)]


def gather_ms(weight, scale, sets: list[torch.Tensor], out: torch.Tensor, programs: int) -> float:
    """Median ms of the Triton zero-copy gather (64 rows x 8 warps per program), a fresh id set each time."""
    out = out[: sets[0].numel()]
    return time_ms(
        lambda rep: gather_dequantize(
            weight, scale, sets[rep % ID_SETS], out=out, launch=GatherLaunch(64, 8, programs)
        ),
        max_reps=MAX_REPS,
    )


def pinned_copy_gbps(device: torch.device) -> float:
    pinned = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(GIB, dtype=torch.uint8, device=device)
    return GIB / time_ms(lambda _r: target.copy_(pinned, non_blocking=True)) / 1e6


def probe_backing(report: Report, args, kind: str, device: torch.device, copy_gbps: float) -> None:
    nbytes = args.table_gib * GIB
    rows = nbytes // (ROW_BYTES + SCALE_BYTES)
    backing = Backing(kind, nbytes, device.index or 0)
    try:
        label = f"{kind} {args.table_gib} GiB"
        report.note(f"{label}: set up in {backing.setup_s:.1f} s, granularity {getattr(backing, 'granularity', '-')}")
        whole = host_tensor(backing.address, nbytes, device)
        started = time.monotonic()
        whole.fill_(0x38)  # e4m3 1.0 everywhere (written by the GPU)
        scale = whole[rows * ROW_BYTES : rows * (ROW_BYTES + SCALE_BYTES)].view(rows, SCALE_BYTES)
        scale.fill_(127)
        torch.cuda.synchronize()
        report.note(f"{label}: GPU fill at {nbytes / (time.monotonic() - started) / 1e9:.1f} GB/s")
        weight = whole[: rows * ROW_BYTES].view(rows, ROW_BYTES)
        generator = torch.Generator(device=device).manual_seed(7)

        with fenced(report, f"{label} check"):  # CPU writes, GPU gathers: both see the same bytes
            check_rows = 4096
            codes = backing.cpu_view(0, check_rows * ROW_BYTES)
            codes[:] = np.random.default_rng(3).integers(0, 256, codes.size, dtype=np.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
            ids = torch.randint(0, check_rows, (2000,), device=device, generator=generator)
            got = gather_dequantize(weight, scale, ids)
            cpu_weight = torch.from_numpy(codes.copy()).view(check_rows, ROW_BYTES)
            cpu_scale = torch.full((check_rows, SCALE_BYTES), 127, dtype=torch.uint8)
            want = gather_dequantize_reference(cpu_weight, cpu_scale, ids.cpu())
            report.add("check", backing=label, rows=2000, equal=bool(torch.equal(got.cpu(), want)))

        out = torch.empty(max(ROWS_PER_STEP), ROW_BYTES, dtype=torch.bfloat16, device=device)
        raw = torch.empty(max(ROWS_PER_STEP), ROW_BYTES, dtype=torch.uint8, device=device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        for count in ROWS_PER_STEP:
            sets = id_sets(count, rows, generator, device)
            for programs in (32, sms * 2, sms * 16):
                with fenced(report, f"{label} gather {count} {programs}"):
                    ms = gather_ms(weight, scale, sets, out, programs)
                    gbps = count * (ROW_BYTES + SCALE_BYTES) / ms / 1e6
                    report.add(
                        "gather", backing=label, rows=count, programs=programs, ms=ms, gbps=gbps,
                        pct_copy=100 * gbps / copy_gbps,
                    )  # fmt: skip

        count = 262_144
        for footprint_mib in FOOTPRINTS_MIB:
            high = rows if footprint_mib is None else min(rows, footprint_mib * 2**20 // ROW_BYTES)
            sets = id_sets(min(count, high // 2), high, generator, device)
            with fenced(report, f"{label} footprint {footprint_mib}"):
                ms = gather_ms(weight, scale, sets, out, 32)
                gbps = sets[0].numel() * (ROW_BYTES + SCALE_BYTES) / ms / 1e6
                report.add(
                    "footprint", backing=label, footprint_mib=footprint_mib or nbytes >> 20, rows=sets[0].numel(),
                    gbps=gbps, pct_copy=100 * gbps / copy_gbps,
                )  # fmt: skip

        stride = rows // (count + 1)
        shift = [stride * i // ID_SETS for i in range(ID_SETS)]  # a fresh set of pages each repetition
        strided = [torch.arange(count, device=device) * stride + first for first in shift]
        with fenced(report, f"{label} strided"):
            ms_kernel = gather_ms(weight, scale, strided, out, 32)
            ms_ce = time_ms(
                lambda rep: copy_engine_strided(
                    backing.address + shift[rep % ID_SETS] * ROW_BYTES, stride * ROW_BYTES, raw, count
                ),
                max_reps=MAX_REPS,
            )
            copy_engine_strided(backing.address + shift[1] * ROW_BYTES, stride * ROW_BYTES, raw, count)
            torch.cuda.synchronize()
            equal = bool(torch.equal(raw[:count], weight.index_select(0, strided[1])))
            report.add(
                "strided", backing=label, rows=count, stride_bytes=stride * ROW_BYTES,
                kernel_gbps=count * (ROW_BYTES + SCALE_BYTES) / ms_kernel / 1e6,
                copy_engine_gbps=count * ROW_BYTES / ms_ce / 1e6, copy_engine_equal=equal,
            )  # fmt: skip
    finally:
        torch.cuda.synchronize()
        backing.close()


def cpu_gather_ms(pool: ThreadPoolExecutor, table: np.ndarray, ids: np.ndarray, out: np.ndarray, lanes: int) -> float:
    """Wall ms for ``lanes`` threads to ``numpy.take`` rows ``ids`` of ``table`` into ``out``."""
    bounds = np.linspace(0, len(ids), lanes + 1).astype(int)

    def lane(i: int) -> None:
        np.take(table, ids[bounds[i] : bounds[i + 1]], axis=0, out=out[bounds[i] : bounds[i + 1]])

    started = time.perf_counter()
    list(pool.map(lane, range(lanes)))
    return (time.perf_counter() - started) * 1e3


def probe_records(report: Report, args, kind: str, device: torch.device, copy_gbps: float) -> None:
    """The same host memory read as separate code and scale tables, and as 264-byte records (scales inline)."""
    nbytes = args.table_gib * GIB
    record = ROW_BYTES + SCALE_BYTES
    rows = nbytes // record
    backing = Backing(kind, nbytes, device.index or 0)
    lanes = args.cpu_lanes
    pool = ThreadPoolExecutor(lanes)
    try:
        label = f"{kind} {args.table_gib} GiB"
        report.note(f"{label}: set up in {backing.setup_s:.1f} s")
        whole = host_tensor(backing.address, nbytes, device)
        whole.fill_(0x38)
        torch.cuda.synchronize()
        records = whole[: rows * record].view(rows, record)
        layouts = {
            "separate": (whole[: rows * ROW_BYTES].view(rows, ROW_BYTES),
                         whole[rows * ROW_BYTES : rows * record].view(rows, SCALE_BYTES)),
            "records": (records[:, :ROW_BYTES], records[:, ROW_BYTES:]),
        }  # fmt: skip
        cpu_all = backing.cpu_view(0, rows * record)
        cpu_tables = {
            "separate": cpu_all[: rows * ROW_BYTES].reshape(rows, ROW_BYTES),
            "records": cpu_all.reshape(rows, record),
        }
        with fenced(report, f"{label} records check"):
            check_rows = 4096
            head = cpu_tables["records"][:check_rows]
            rng = np.random.default_rng(3)
            codes = rng.integers(0, 256, (check_rows, ROW_BYTES), dtype=np.uint8)
            codes[(codes & 0x7F) == 0x7F] = 0
            head[:, :ROW_BYTES] = codes
            head[:, ROW_BYTES:] = rng.integers(110, 140, (check_rows, SCALE_BYTES), dtype=np.uint8)
            generator = torch.Generator(device=device).manual_seed(1)
            ids = torch.randint(0, check_rows, (2000,), device=device, generator=generator)
            got = gather_dequantize(*layouts["records"], ids, launch=GatherLaunch(64, 8, 32))
            cpu_records = torch.from_numpy(head.copy())
            want = gather_dequantize_reference(cpu_records[:, :ROW_BYTES], cpu_records[:, ROW_BYTES:], ids.cpu())
            report.add("check", backing=f"{label} records", rows=2000, equal=bool(torch.equal(got.cpu(), want)))
        generator = torch.Generator(device=device).manual_seed(7)
        out = torch.empty(max(ROWS_PER_STEP), ROW_BYTES, dtype=torch.bfloat16, device=device)
        staging = torch.empty(max(ROWS_PER_STEP), record, dtype=torch.uint8, pin_memory=True)
        raw = torch.empty(max(ROWS_PER_STEP), record, dtype=torch.uint8, device=device)
        for count in ROWS_PER_STEP:
            sets = id_sets(count, rows, generator, device)
            cpu_sets = [ids.cpu().numpy() for ids in sets]
            payload = count * record
            for layout, (weight, scale) in layouts.items():
                for programs in (32, 64) if layout == "records" else (32,):
                    with fenced(report, f"{label} {layout} gather {count}"):
                        ms = gather_ms(weight, scale, sets, out, programs)
                        report.add(
                            "layout_gather", backing=label, layout=layout, rows=count, programs=programs, ms=ms,
                            gbps=payload / ms / 1e6, pct_copy=100 * payload / ms / 1e6 / copy_gbps,
                        )  # fmt: skip
                with fenced(report, f"{label} {layout} cpu gather {count}"):
                    table = cpu_tables[layout]
                    width = table.shape[1]
                    target = staging.numpy()[:count, :width]
                    times = [cpu_gather_ms(pool, table, ids, target, lanes) for ids in cpu_sets[:5]]
                    ms = statistics.median(times[1:])
                    report.add(
                        "cpu_gather", backing=label, layout=layout, rows=count, lanes=lanes, ms=ms,
                        gbps=count * width / ms / 1e6,
                    )  # fmt: skip
            for share in args.shares:
                with fenced(report, f"{label} split {count} {share}"):
                    cut = int(count * share)
                    weight, scale = layouts["records"]
                    table = cpu_tables["records"]
                    times = []
                    for ids, ids_cpu in zip(sets[5:], cpu_sets[5:], strict=True):
                        rest = ids_cpu[cut:]
                        torch.cuda.synchronize()
                        started = time.perf_counter()
                        gather_dequantize(weight, scale, ids[:cut], out=out[:cut], launch=GatherLaunch(64, 8, 32))
                        cpu_gather_ms(pool, table, rest, staging.numpy()[: len(rest)], lanes)
                        raw[: len(rest)].copy_(staging[: len(rest)], non_blocking=True)
                        gather_dequantize(
                            raw[: len(rest), :ROW_BYTES], raw[: len(rest), ROW_BYTES:],
                            torch.arange(len(rest), device=device), out=out[cut:count],
                        )  # fmt: skip
                        torch.cuda.synchronize()
                        times.append((time.perf_counter() - started) * 1e3)
                    ms = statistics.median(times[1:])
                    report.add(
                        "split_records", backing=label, rows=count, zero_copy_share=share, ms=ms,
                        gbps=payload / ms / 1e6, pct_copy=100 * payload / ms / 1e6 / copy_gbps,
                    )  # fmt: skip
    finally:
        torch.cuda.synchronize()
        pool.shutdown()
        backing.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--table-gib", type=int, default=64)
    parser.add_argument("--backings", nargs="+", default=["vmm", "registered", "hostalloc", "vmm_min"])
    parser.add_argument("--deadline-s", type=float, default=500.0)
    parser.add_argument("--suite", choices=("backings", "records"), default="backings")
    parser.add_argument("--cpu-lanes", type=int, default=16)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.4, 0.5, 0.6])
    parser.add_argument("--huge-pages", type=int, default=0, help="2 MiB pages to reserve first (root)")
    args = parser.parse_args()
    report = Report(Path(args.out), name="engram_translation_probe")
    device = torch.device("cuda:0")
    torch.zeros(1, device=device)
    started = time.monotonic()
    system_report(report)
    lib = cuda_driver().lib
    for attribute, name in ((134, "host NUMA id"), (141, "host NUMA VMM supported")):
        value = ctypes.c_int(-99)
        code = lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, 0)
        report.note(f"device attribute {name}: {value.value} (code {code})")
    for which in ("recommended", "minimum"):
        with fenced(report, f"granularity {which}"):
            report.note(f"host NUMA granularity ({which}): {VmmHostMemory.query_granularity(which=which)}")
    if args.huge_pages:
        configure_huge_pages(args.huge_pages, report)
    copy_gbps = pinned_copy_gbps(device)
    report.add("copy", what="pinned 1 GiB host to device", gbps=copy_gbps)
    for kind in args.backings:
        if time.monotonic() - started > args.deadline_s:
            report.note(f"deadline: {kind} skipped")
            continue
        with section(report, kind):
            probe = probe_records if args.suite == "records" else probe_backing
            probe(report, args, kind, device, copy_gbps)
        if kind == "registered_2m":
            release_huge_pages()  # the pool would otherwise hold the memory the next backing needs


if __name__ == "__main__":
    main()
