"""Engram fetch on a GPU: host gathers (zero-copy and staged) against the pinned copy ceiling, and a prefill step.

    python benchmarks/engram_fetch.py --out results/ [--suite full|staged] [--table-gib 16 64 32]
        [--page-sizes 4k 2m] [--tables 16:4k 16:2m 64:2m ...] [--rows 4096 ... 524288]
        [--configure-huge-pages] [--tokenizer tokenizer.json] [--prefill-tokens 65536 --prefill-layers 16]
        [--threads N --chunk-rows N --zero-copy-share 0.5]
        [--grid-threads 4 8 16 --grid-chunks 4096 16384 32768 --grid-shares 0.3 0.4 0.6]
        [--deadline-s 390] [--check-only]

What it does, in order (each section is fenced: a failure is logged and the next section runs):

1. **Correctness first.** Random tables in a real :class:`~dsinfer.engram.store.EngramStore`; the
   ``host`` placement by each method (``zero_copy``: registered segment, Triton kernel; ``staged``:
   CPU gather in small chunks and rounds, copies, GPU dequantisation; ``split``: both on two shares)
   and the ``device`` placement on the GPU against the CPU reference, bit for bit, bf16 and fp32,
   with and without de-duplication, sync and prefetched; outputs poisoned first so an unwritten row
   shows.
2. **Ceilings.** Pinned host-to-device copy bandwidth (``cudaHostAlloc`` buffer and the registered
   segment itself), measured in the same run, for the gather/copy ratio.
3. **Per table size and page size** (4 KiB ``/dev/shm``; 2 MiB hugetlbfs).

   ``--suite full`` (zero-copy exploration): gather throughput against rows per step for random-order
   ids (fresh each repetition, and the same ids repeated, as a naive timing loop does), sorted ids,
   sorted ids with the scales in device memory, and the full fetch (plan + gather + expand) on ids
   hashed from a Zipf token stream with and without de-duplication. On the first table also: a
   footprint sweep (same row count, ids confined to the first W bytes) to expose translation-cache
   reach, kernel-shape variants, torch's own ``index_select`` through the same zero-copy tensor, a
   CPU gather + copy, and the ``device`` placement.

   ``--suite staged`` (the host methods compared; tables 16:4k 64:4k 64:2m unless ``--tables`` says
   otherwise, about 3.5 minutes with ``--configure-huge-pages``): zero-copy, staged and split over
   rows per step on sorted unique ids and on the full fetch of hashed text ids, as GB/s and % of the
   pinned copy (``staged_summary``); on the first table also the staged lanes x chunk rows grid, the
   split's zero-copy share, the CPU gather alone (numpy in threads), and torch's ``index_select``
   over its intra-op threads plus one copy, unpipelined.
4. **Prefill step** (first table in the staged suite). A V4.1-width slice (hidden 5120, 64x512 heads,
   q rank 1280, 8x1024 output groups, 6+1 experts x 2304 as dense matmuls) over 65,536 tokens with
   Engram at layers 1 and 14, bf16: no fetch (rows already on the GPU), synchronous and prefetched
   fetches by each host method (``start_host_ms``: the caller's time in ``start``); the full suite
   adds request-order fetches, program caps and i.i.d. Zipf ids.

Results go to ``--out`` as ``engram_fetch.json`` and ``engram_fetch.md`` after every measurement.
GB/s is 1e9 bytes per second. "payload" counts the bytes read over PCIe (unique rows x 264: 256 FP8
bytes plus 8 scale bytes; 256 with scales in device memory); "effective" counts rows requested x 256.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from engram_fetch_common import (  # the plumbing (same folder)
    Report,
    TextIds,
    _bits,
    configure_huge_pages,
    fenced,
    random_ids,
    release_huge_pages,
    section,
    system_report,
    time_ms,
)
from engram_fetch_prefill import run_prefill  # part 4 (same folder)

from dsinfer.arg_types import positive_int
from dsinfer.engram.fetch import DEFAULT_SPLIT_MIN_IDS, DeviceEngramFetcher, HostEngramFetcher
from dsinfer.engram.staged_gather import DEFAULT_CHUNK_ROWS
from dsinfer.engram.store import HUGE_PAGE_BYTES, EngramMemoryError, EngramStore, RandomEngramSource, segment_bytes
from dsinfer.engram.store.memory import meminfo
from dsinfer.kernels.engram_gather import (
    GatherLaunch,
    dequantize_rows,
    gather_dequantize,
    gather_dequantize_reference,
)

ROW_BYTES, SCALE_BYTES = 256, 8
GIB = 2**30
STAGED_TABLES = ("16:4k", "64:4k", "64:2m")


# ------------------------------------------------------------------------------------------ 1. correctness
def check_correctness(report: Report, device: torch.device) -> bool:
    source = RandomEngramSource({1: 200_003, 14: 100_019}, seed=5)
    ok = True
    edge_row = 77_777  # its scales span 2**-127 .. 2**127: subnormal and overflowing products
    with EngramStore.create(f"dsinfer-bench-{uuid.uuid4().hex[:8]}", source) as store:
        store.scale(1)[edge_row] = torch.tensor([0, 1, 2, 126, 127, 128, 200, 254], dtype=torch.uint8)
        reference = HostEngramFetcher.from_store(store, "cpu", method="zero_copy")
        host = HostEngramFetcher.from_store(store, device, method="zero_copy")
        # Small chunks and three lanes: many chunks per fetch, so chunk edges and buffer reuse are exercised.
        staging = {"staging_threads": 3, "staging_chunk_rows": 1000, "staging_rows": 2500}  # rounds, many chunks
        staged = HostEngramFetcher.from_store(store, device, method="staged", **staging)
        split = split_fetcher(store, host, zero_copy_share=0.37, split_min_ids=0, **staging)
        on_device = DeviceEngramFetcher.from_store(store, device)
        fetchers = {"host": host, "host staged": staged, "host split": split, "device": on_device}
        for fetcher in fetchers.values():
            fetcher.dedup_min_ids = 0  # the plan at every size here
        generator = torch.Generator().manual_seed(1)
        for name, fetcher in fetchers.items():
            for dtype in (torch.bfloat16, torch.float32):
                for dedup in (True, False):
                    fetcher.out_dtype, reference.out_dtype = dtype, dtype
                    fetcher.dedup = fetcher.sort = dedup
                    for layer, rows in ((1, 200_003), (14, 100_019)):
                        ids = torch.randint(0, rows, (999, 24), generator=generator)
                        ids[:300] = ids[0]
                        ids[5, :3] = torch.tensor([0, rows - 1, rows // 2])
                        ids[ids == edge_row] = 1  # realistic scales here; the edge row is checked below
                        expected = reference.fetch(ids, layer)
                        got = fetcher.fetch(ids.to(device), layer).cpu()
                        fetcher.start({layer: ids.to(device)})
                        got_prefetched = fetcher.wait(layer).cpu()
                        same = torch.equal(_bits(got), _bits(expected)) and torch.equal(
                            _bits(got_prefetched), _bits(expected)
                        )
                        ok &= same
                        report.add(
                            "correctness",
                            placement=name,
                            dtype=str(dtype)[6:],
                            dedup=dedup,
                            layer=layer,
                            ids=ids.numel(),
                            bit_equal=same,
                        )
        # Poisoned output: every row below `count` written, none above; edge exponents (2**-127, 2**127).
        weight, scale = host.tables[1]
        ids = torch.randint(0, 200_003, (5000,), generator=generator)
        ids[ids == edge_row] = 1
        ids[0] = edge_row
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.full((5000, 256), float("nan"), dtype=dtype, device=device)
            count = torch.tensor([4000], device=device)
            gather_dequantize(weight, scale, ids.to(device), count=count, out=out, out_dtype=dtype)
            expected = gather_dequantize_reference(store.weight(1), store.scale(1), ids[:4000], dtype)
            got = out[:4000].cpu()
            realistic = torch.equal(_bits(got[1:]), _bits(expected[1:]))
            edge = torch.equal(_bits(got[:1]), _bits(expected[:1]))
            untouched = bool(out[4000:].isnan().all())
            ok &= realistic and untouched
            report.add(
                "correctness",
                placement="host-kernel",
                dtype=str(dtype)[6:],
                poisoned_rows_written=realistic,
                tail_untouched=untouched,
                edge_exponents_bit_equal=edge,
            )
            # The staged method's dequantisation: the same kernel on rows already in device memory.
            rows = dequantize_rows(store.weight(1)[ids].to(device), store.scale(1)[ids].to(device), out_dtype=dtype)
            expected = gather_dequantize_reference(store.weight(1), store.scale(1), ids, dtype)
            same = torch.equal(_bits(rows[1:].cpu()), _bits(expected[1:]))
            ok &= same
            report.add(
                "correctness",
                placement="dequantize_rows",
                dtype=str(dtype)[6:],
                rows_bit_equal=same,
                edge_exponents_bit_equal=torch.equal(_bits(rows[:1].cpu()), _bits(expected[:1])),
            )
        for fetcher in (split, staged, host):
            fetcher.close()
    report.note(f"correctness: {'all bit-equal' if ok else 'MISMATCH, see the correctness table'}")
    return ok


# ------------------------------------------------------------------------------------------ 2. ceilings
def copy_ceilings(report: Report, device: torch.device, host_view: torch.Tensor | None, label: str) -> float:
    """Pinned host-to-device copy GB/s (median of repeated 1 GiB copies); returns the best."""
    nbytes = GIB if host_view is None else min(GIB, host_view.numel())
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sources = {}
    if host_view is None:
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        pinned.fill_(0x5A)  # PCIe does not compress: the contents do not matter here
        sources["cudaHostAlloc buffer"] = pinned
    else:
        sources[f"registered segment ({label})"] = host_view[:nbytes]
    best = 0.0
    for name, src in sources.items():
        ms = time_ms(lambda rep, src=src: target.copy_(src, non_blocking=True), min_reps=5, max_reps=10)
        gbps = nbytes / ms / 1e6
        best = max(best, gbps)
        report.add("copy_ceiling", source=name, bytes=nbytes, ms=ms, gb_per_s=gbps)
    back = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    ms = time_ms(lambda rep: back.copy_(target, non_blocking=True), min_reps=5, max_reps=10)
    report.add("copy_ceiling", source=f"device-to-host ({label})", bytes=nbytes, ms=ms, gb_per_s=nbytes / ms / 1e6)
    return best


# ------------------------------------------------------------------------------------------ 3. gathers
def gather_sweep(report, store, fetcher, args, device, label, state, text_ids, copy_gbps) -> None:
    table = store.tables[1]
    rows = table.rows
    weight, scale = fetcher.tables[1]
    scale_on_device = store.scale(1).to(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    generator = torch.Generator(device=device).manual_seed(2)
    max_rows = max(args.rows)
    out = torch.empty(max_rows, ROW_BYTES, dtype=torch.bfloat16, device=device)

    def kernel(ids, *, scales=scale, block_rows=32, num_warps=4, programs=None):
        launch = GatherLaunch(block_rows, num_warps, programs)
        gather_dequantize(weight, scales, ids, out=out[: ids.numel()], launch=launch)

    def record(kind, count, ms, payload_row_bytes=ROW_BYTES + SCALE_BYTES, unique=None, **extra):
        unique = count if unique is None else unique
        payload = unique * payload_row_bytes / ms / 1e6
        report.add(
            "gather",
            table=label,
            kind=kind,
            rows=count,
            unique=unique,
            ms=ms,
            payload_gb_s=payload,
            effective_gb_s=count * ROW_BYTES / ms / 1e6,
            vs_copy=payload / copy_gbps,
            **extra,
        )

    def measure(kind, sets, payload_row_bytes=ROW_BYTES + SCALE_BYTES, **options):
        """Time the kernel over ``sets`` (rotating; one set = the same ids every repetition)."""
        ms = time_ms(lambda rep: kernel(sets[rep % len(sets)], **options))
        record(kind, sets[0].numel(), ms, payload_row_bytes)

    def measure_fetch(kind, steps, dedup):
        fetcher.dedup = fetcher.sort = dedup
        fetcher.dedup_min_ids = 0
        ms = time_ms(lambda rep: fetcher.fetch(steps[rep % len(steps)], 1))
        fetcher.dedup = fetcher.sort = True
        unique = int(torch.unique(steps[0]).numel()) if dedup else None
        record(kind, steps[0].numel(), ms, unique=unique)

    for count in args.rows:
        fresh = [random_ids(count, rows, generator, device) for _ in range(4)]
        fresh_sorted = [ids.sort().values for ids in fresh]
        measure("random", fresh)
        measure("random, same ids every rep", fresh[:1])
        measure("sorted", fresh_sorted)
        measure("sorted, scales on device", fresh_sorted, ROW_BYTES, scales=scale_on_device)
        # The whole fetch (plan + gather + expand) on hashed text ids.
        steps = [text_ids.ids(max(1, count // 24), rows)[1] for _ in range(2)]
        measure_fetch("fetch text ids, dedup+sort", steps, True)
        measure_fetch("fetch text ids, no dedup, request order", steps, False)
    # Footprint (once per page size): one row count, ids confined to the first W bytes of the table.
    count = 262_144 if 262_144 in args.rows else max_rows
    page = label.split()[-1]
    if page in state.setdefault("footprint_done", set()):
        return
    state["footprint_done"].add(page)
    for window_gib in (1 / 16, 1 / 2, 2, 8, rows * ROW_BYTES / GIB):
        window = min(rows, int(window_gib * GIB / ROW_BYTES))
        ids = [random_ids(count, window, generator, device) for _ in range(4)]
        ids_sorted = [i.sort().values for i in ids]
        measure(f"footprint {window_gib:g} GiB, random", ids)
        measure(f"footprint {window_gib:g} GiB, sorted", ids_sorted)
    if state.get("extras_done"):
        return
    state["extras_done"] = True

    # Kernel shapes: rows per program, warps, program cap.
    ids = [random_ids(count, rows, generator, device) for _ in range(4)]
    ids_sorted = [i.sort().values for i in ids]
    for block_rows, num_warps, programs in (
        (16, 4, None),
        (32, 4, None),
        (64, 4, None),
        (64, 8, None),
        (128, 8, None),
        (32, 4, sms),
        (32, 4, 4 * sms),
        (64, 8, 2 * sms),
        (32, 4, 32),
        (64, 8, 32),
        (64, 8, 16),
    ):
        shape = {"block_rows": block_rows, "num_warps": num_warps, "programs": programs}
        label_shape = f"shape {block_rows}x{num_warps}w programs={programs or 'all'}"
        measure(f"{label_shape}, random", ids, **shape)
        measure(f"{label_shape}, sorted", ids_sorted, **shape)

    # torch's own CUDA index_select through the same zero-copy tensor (bytes; and 8-byte words).
    as_words = weight.view(torch.int64)
    ms = time_ms(lambda rep: weight.index_select(0, ids_sorted[rep % 4]), max_reps=5)
    record("torch index_select uint8 (no dequant), sorted", count, ms, ROW_BYTES)
    ms = time_ms(lambda rep: as_words.index_select(0, ids_sorted[rep % 4]), max_reps=5)
    record("torch index_select int64 words (no dequant), sorted", count, ms, ROW_BYTES)

    # CPU gather into a pinned buffer, then one copy (16 threads).
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    cpu_weight, cpu_ids = store.weight(1), ids_sorted[0].cpu()
    staging = torch.empty(count, ROW_BYTES, dtype=torch.uint8, pin_memory=True)
    landing = torch.empty(count, ROW_BYTES, dtype=torch.uint8, device=device)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        started = time.perf_counter()
        torch.index_select(cpu_weight, 0, cpu_ids, out=staging)
        landing.copy_(staging, non_blocking=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    record("CPU index_select + pinned copy (no dequant), sorted", count, statistics.median(times), ROW_BYTES)

    # The device placement: the same table in GPU memory.
    device_weight = store.weight(1).to(device)
    for count in args.rows:
        ids = [random_ids(count, rows, generator, device) for _ in range(4)]
        target = out[:count]
        ms = time_ms(
            lambda rep, ids=ids, target=target: gather_dequantize(
                device_weight, scale_on_device, ids[rep % 4], out=target
            )
        )
        record("device placement (HBM), random", count, ms)


def run_table(report, args, device, table_gib, page, text_ids, state) -> None:
    try:
        _run_table(report, args, device, table_gib, page, text_ids, state)
    finally:
        gc.collect()
        if page == "2m" and args.configure_huge_pages:
            release_huge_pages()


def _run_table(report, args, device, table_gib, page, text_ids, state) -> None:
    rows = int(table_gib * GIB) // ROW_BYTES
    label = f"{table_gib:g} GiB {page}"
    source = RandomEngramSource({1: rows}, seed=9, tile_rows=1 << 16)
    huge = page == "2m"
    needed = segment_bytes(source.table_specs())
    if huge and args.configure_huge_pages:
        configure_huge_pages(needed // HUGE_PAGE_BYTES + 4, report)
    if huge:
        fallback = EngramStore._choose_location(source.table_specs(), huge_pages=True)[2]
        if fallback:
            report.note(f"{label}: no huge pages ({fallback}); skipped")
            state["huge_unavailable"] = True
            return
    started = time.monotonic()
    name = f"dsinfer-bench-{uuid.uuid4().hex[:8]}"
    try:
        store = EngramStore.create(name, source, huge_pages=huge)
    except EngramMemoryError as exc:
        report.note(f"{label}: {exc}")
        if meminfo().get("MemTotal", 0) < needed * 1.15:
            return
        report.note(f"{label}: MemTotal is large enough; retrying without the memory check")
        store = EngramStore.create(name, source, huge_pages=huge, check_memory=False)
    with store:
        created = time.monotonic() - started
        if huge and not store.huge_pages:
            report.note(f"{label}: fell back to 4 KiB pages ({store.huge_pages_fallback}); skipped")
            state["huge_unavailable"] = True
            return
        started = time.monotonic()
        fetcher = HostEngramFetcher.from_store(store, device, method="zero_copy")
        registered = time.monotonic() - started
        staging = {"staging_threads": args.threads, "staging_chunk_rows": args.chunk_rows}
        methods = {
            "zero_copy": fetcher,
            "staged": HostEngramFetcher.from_store(store, device, method="staged", **staging),
            "split": split_fetcher(store, fetcher, zero_copy_share=args.zero_copy_share, **staging),
        }
        report.add(
            "tables",
            table=label,
            bytes=store.nbytes,
            page_size=store.page_size,
            create_s=created,
            load_gb_s=store.nbytes / created / 1e9,
            register_s=registered,
        )
        try:
            ids = torch.randint(0, rows, (4096,))
            expected = _bits(gather_dequantize_reference(store.weight(1), store.scale(1), ids))
            methods["split"].split_min_ids = 0  # split even these 4096 ids
            for name, method in methods.items():
                same = torch.equal(_bits(method.fetch(ids.to(device), 1).cpu()), expected)
                report.add("correctness", placement=f"host {name} {label}", dtype="bfloat16", ids=4096, bit_equal=same)
            methods["split"].split_min_ids = DEFAULT_SPLIT_MIN_IDS
            if args.suite == "staged":
                copy_gbps = state.get("copy_gbps") or copy_ceilings(report, device, None, "pinned")
                with fenced(report, f"{label}: staged sweep"):
                    staged_sweep(report, store, methods, args, device, label, state, text_ids, copy_gbps)
                wants_prefill = True  # on the first table: the run's time limit may not reach the others
            else:
                segment_view = store.base_tensor()
                copy_gbps = copy_ceilings(report, device, segment_view[store.tables[1].offset :], label)
                copy_gbps = max(copy_gbps, state.get("copy_gbps", 0.0))
                del segment_view  # no tensor may outlive the store's mapping, or its memory stays mapped
                gather_sweep(report, store, fetcher, args, device, label, state, text_ids, copy_gbps)
                wants_prefill = huge or state.get("huge_unavailable") or "2m" not in state.get("pages", ())
            if args.prefill_tokens and not state.get("prefill_done") and wants_prefill:
                run_prefill(report, args, device, store, methods, text_ids, label)
                state["prefill_done"] = True
        finally:
            for method in reversed(methods.values()):  # the zero-copy fetcher, which registered the segment, last
                method.close()
            del fetcher, methods


def split_fetcher(store: EngramStore, zero_copy: HostEngramFetcher, **options) -> HostEngramFetcher:
    """A ``split`` fetcher over the segment ``zero_copy`` has registered already (a range registers once)."""
    host_tables = {layer: (store.weight(layer), store.scale(layer)) for layer in store.layer_ids}
    return HostEngramFetcher(
        dict(zero_copy.tables), device=zero_copy.device, method="split", host_tables=host_tables, **options
    )


# ------------------------------------------------------------------------------------------ 3b. staged
def staged_sweep(report, store, methods, args, device, label, state, text_ids, copy_gbps) -> None:
    """The host methods over rows per step; on the first table also lanes x chunk rows, shares and CPU baselines.

    "sorted unique rows" times ``fetch`` of ids that are already sorted and unique (plan off): the
    gather alone, from ids on the GPU to dequantised rows on the GPU, so the staged and split times
    include their device-to-host copy of the ids. "fetch text ids" is the whole fetch (plan + gather
    + expand).
    """
    rows = store.tables[1].rows
    generator = torch.Generator(device=device).manual_seed(3)

    def record(method, kind, requested, unique, ms, **extra):
        payload = unique * (ROW_BYTES + SCALE_BYTES) / ms / 1e6
        report.add(
            "staged",
            table=label,
            method=method,
            kind=kind,
            rows=requested,
            unique=unique,
            ms=ms,
            payload_gb_s=payload,
            pct_of_copy=100 * payload / copy_gbps,
            effective_gb_s=requested * ROW_BYTES / ms / 1e6,
            **extra,
        )

    # A fresh set for each of time_ms's calls (2 warm-ups, 1 estimate, at most 8 timed): rows read again
    # would find their address translations cached, which flatters small fetches.
    def sorted_sets(count, sets=11):
        return [torch.unique(random_ids(count, rows, generator, device)) for _ in range(sets)]

    def gather_ms(fetcher, sets):
        fetcher.dedup = fetcher.sort = False
        try:
            return time_ms(lambda rep: fetcher.fetch(sets[rep % len(sets)], 1), min_reps=3, max_reps=len(sets) - 3)
        finally:
            fetcher.dedup = fetcher.sort = True

    for count in args.rows:
        with fenced(report, f"{label}: {count} rows"):
            sets = sorted_sets(count)
            unique = sets[0].numel()
            gbps = {}
            for method, fetcher in methods.items():
                ms = gather_ms(fetcher, sets)
                record(method, "sorted unique rows", unique, unique, ms)
                gbps[method] = unique * (ROW_BYTES + SCALE_BYTES) / ms / 1e6
            summary = {}
            for method, rate in gbps.items():
                summary[f"{method}_gb_s"] = rate
                summary[f"{method}_pct_of_copy"] = 100 * rate / copy_gbps
            best = max(gbps, key=gbps.get)
            report.add("staged_summary", table=label, rows=unique, **summary, fastest=best)
            steps = [text_ids.ids(max(1, count // 24), rows)[1] for _ in range(2)]
            unique = int(torch.unique(steps[0]).numel())
            for method, fetcher in methods.items():
                fetcher.dedup_min_ids = 0
                ms = time_ms(lambda rep, f=fetcher, steps=steps: f.fetch(steps[rep % 2], 1), min_reps=3, max_reps=15)
                record(method, "fetch text ids, dedup+sort", steps[0].numel(), unique, ms)
    if state.get("grid_done"):
        return
    state["grid_done"] = True

    # Lanes x chunk rows, at the largest step sizes.
    counts = [count for count in args.rows if count >= 131_072][-2:] or [max(args.rows)]
    sets = {count: sorted_sets(count) for count in counts}
    for threads in args.grid_threads:
        for chunk in args.grid_chunks:
            with fenced(report, f"{label}: staged lanes={threads} chunk={chunk}"):
                fetcher = HostEngramFetcher.from_store(
                    store, device, method="staged", staging_threads=threads, staging_chunk_rows=chunk
                )
                try:
                    for count in counts:
                        ms = gather_ms(fetcher, sets[count])
                        record(
                            "staged",
                            "grid",
                            sets[count][0].numel(),
                            sets[count][0].numel(),
                            ms,
                            lanes=threads,
                            chunk_rows=chunk,
                        )
                finally:
                    fetcher.close()

    # The split's zero-copy share.
    staging = {"staging_threads": args.threads, "staging_chunk_rows": args.chunk_rows}
    for share in args.grid_shares:
        with fenced(report, f"{label}: split share={share}"):
            fetcher = split_fetcher(store, methods["zero_copy"], zero_copy_share=share, **staging)
            try:
                for count in counts:
                    ms = gather_ms(fetcher, sets[count])
                    unique = sets[count][0].numel()
                    record("split", "share", unique, unique, ms, zero_copy_share=share)
            finally:
                fetcher.close()

    # Where the time goes: the CPU gather alone, by numpy in threads (one slice each, as the lanes do it
    # but without chunks or copies), and by torch's index_select over its intra-op threads into pinned
    # buffers followed by one copy, unpipelined.
    records = store.records(1)
    ids = sets[counts[-1]][0].cpu()
    count = ids.numel()
    for threads in args.grid_threads:
        with fenced(report, f"{label}: numpy threads={threads}"), ThreadPoolExecutor(threads) as pool:
            ms = wall_ms(lambda pool=pool, threads=threads: numpy_gather(pool, threads, records, ids))
            record("numpy.take in threads (CPU only)", "cpu", count, count, ms, lanes=threads)
    staging = torch.empty(count, ROW_BYTES + SCALE_BYTES, dtype=torch.uint8, pin_memory=True)
    landing = torch.empty(count, ROW_BYTES + SCALE_BYTES, dtype=torch.uint8, device=device)
    torch_threads = torch.get_num_threads()
    for threads in args.grid_threads:
        with fenced(report, f"{label}: torch index_select threads={threads}"):
            torch.set_num_threads(threads)

            def cpu_gather():
                torch.index_select(records, 0, ids, out=staging)

            def gather_and_copy():
                cpu_gather()
                landing.copy_(staging, non_blocking=True)
                torch.cuda.synchronize(device)

            record("torch index_select only", "cpu", count, count, wall_ms(cpu_gather), lanes=threads)
            record("torch index_select + copy", "unpipelined", count, count, wall_ms(gather_and_copy), lanes=threads)
    torch.set_num_threads(torch_threads)


def numpy_gather(pool: ThreadPoolExecutor, threads: int, records, ids) -> None:
    """Records ``ids`` of a table into fresh CPU memory, ``threads`` slices in parallel (numpy releases the GIL)."""
    records, ids = records.numpy(), ids.numpy()
    out = np.empty((ids.shape[0], records.shape[1]), dtype=np.uint8)
    bounds = np.linspace(0, ids.shape[0], threads + 1).astype(int)

    def part(i):
        a, b = bounds[i], bounds[i + 1]
        np.take(records, ids[a:b], axis=0, out=out[a:b], mode="clip")

    list(pool.map(part, range(threads)))


def wall_ms(fn, reps: int = 5) -> float:
    """Median wall-clock milliseconds of ``fn()`` (host work, or host work ending in a synchronisation)."""
    fn()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "engram_fetch_results")))
    parser.add_argument(
        "--suite",
        choices=["full", "staged"],
        default="full",
        help="full: every zero-copy measurement; staged: the host methods compared (about 3.5 min)",
    )
    parser.add_argument("--table-gib", type=float, nargs="+", default=[16, 64, 32])
    parser.add_argument("--rows", type=positive_int, nargs="+", default=[4096, 16384, 65536, 131072, 262144, 524288])
    parser.add_argument("--page-sizes", nargs="+", default=["4k", "2m"], choices=["4k", "2m"])
    parser.add_argument(
        "--tables",
        nargs="+",
        help=f"explicit order of GIB:PAGE runs, e.g. 16:4k 16:2m 64:2m (staged suite: {' '.join(STAGED_TABLES)})",
    )
    parser.add_argument("--threads", type=positive_int, help="lanes of the staged fetcher (default: its own)")
    parser.add_argument("--chunk-rows", type=positive_int, default=DEFAULT_CHUNK_ROWS, help="staged chunk rows")
    parser.add_argument("--grid-threads", type=positive_int, nargs="+", default=[4, 8, 16], help="staged lanes tried")
    parser.add_argument("--grid-chunks", type=positive_int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--zero-copy-share", type=float, default=0.5, help="the split method's zero-copy share")
    parser.add_argument("--grid-shares", type=float, nargs="+", default=[0.3, 0.4, 0.6], help="split shares tried")
    parser.add_argument(
        "--configure-huge-pages",
        action="store_true",
        help="as root, mount hugetlbfs and set vm.nr_hugepages for the 2m runs (then back to 0)",
    )
    parser.add_argument("--prefill-tokens", type=int, default=65536)
    parser.add_argument("--prefill-layers", type=int, default=16)
    parser.add_argument("--prefill-reps", type=int, default=3)
    parser.add_argument(
        "--deadline-s", type=float, help="skip tables that would end later (default 390 s; staged suite 300 s)"
    )
    parser.add_argument("--tokenizer", type=Path, help="a DeepSeek tokenizer.json: real text ids (default: Zipf)")
    parser.add_argument("--check-only", action="store_true")
    args = parser.parse_args()
    if args.suite == "staged" and not args.tables:
        args.tables = list(STAGED_TABLES)
    if args.deadline_s is None:
        args.deadline_s = 300.0 if args.suite == "staged" else 390.0
    for entry in args.tables or []:
        gib, _, page = entry.partition(":")
        try:
            float(gib)
        except ValueError:
            parser.error(f"--tables entries look like 16:4k, got {entry!r}")
        if page not in ("4k", "2m"):
            parser.error(f"--tables entries look like 16:4k or 64:2m, got {entry!r}")
    if not torch.cuda.is_available():
        sys.exit("benchmarks/engram_fetch.py needs a CUDA GPU")
    started = time.monotonic()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    report = Report(args.out)
    with section(report, "system"):
        system_report(report)
    correct = False
    with section(report, "correctness"):
        correct = check_correctness(report, device)
    if args.check_only:
        sys.exit(0 if correct else 1)
    state: dict = {}
    with section(report, "copy ceiling (cudaHostAlloc)"):
        state["copy_gbps"] = copy_ceilings(report, device, None, "pinned")
    try:
        text_ids = TextIds(device, args.tokenizer)
    except Exception as exc:  # noqa: BLE001 - fall back to Zipf tokens
        report.note(f"text ids: {type(exc).__name__}: {exc}; using Zipf tokens")
        text_ids = TextIds(device)
    report.note(f"text ids from {text_ids.source}")
    configs = (
        [(float(g), p) for g, _, p in (entry.partition(":") for entry in args.tables)]
        if args.tables
        else [(g, p) for g in args.table_gib for p in args.page_sizes]
    )
    state["pages"] = [page for _, page in configs]
    for table_gib, page in configs:
        elapsed = time.monotonic() - started
        budget = 30 + 1.3 * table_gib  # seconds a table of this size takes, roughly
        if elapsed + budget > args.deadline_s:
            report.note(f"{table_gib:g} GiB {page}: skipped, {elapsed:.0f} s used of the {args.deadline_s:.0f} s")
            continue
        with section(report, f"table {table_gib:g} GiB, {page} pages"):
            run_table(report, args, device, table_gib, page, text_ids, state)
    report.note(f"total {time.monotonic() - started:.0f} s; correctness {'ok' if correct else 'FAILED'}")
    report.write()
    print(report.markdown())


if __name__ == "__main__":
    main()
