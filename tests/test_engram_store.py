"""Engram shared-memory store: loading, attaching from another process, and no leaked segments.

Helper processes import ``dsinfer.engram.store`` under stand-in ``dsinfer`` / ``dsinfer.engram`` packages
(the store imports only the standard library and numpy; ``dsinfer.engram`` itself imports torch), so each
starts in well under a second instead of paying for a torch import.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from engram_harness import maps_segment
from safetensors.torch import save_file

import dsinfer.engram.store
from dsinfer.engram.store import (
    HUGETLBFS_ENV,
    SHM_DIR,
    EngramMemoryError,
    EngramStore,
    EngramStoreError,
    RandomEngramSource,
    SafetensorsEngramSource,
    remove_stale_segments,
    segment_bytes,
)
from dsinfer.engram.store import memory as store_memory
from dsinfer.engram.store.segment import SegmentHeader

ENGRAM_DIR = Path(dsinfer.engram.store.__file__).parents[1]
ROWS = {1: 3000, 14: 5000}

# A helper process: `python -c CHILD <dsinfer/engram> <role> <name> [rows json] [attachers]`. It prints one
# JSON line when it is set up, then obeys commands read from stdin: "exit", "raise" (uncaught exception), "hang".
CHILD = r"""
import hashlib, json, os, sys, time, types
for package, path in (("dsinfer", os.path.dirname(sys.argv[1])), ("dsinfer.engram", sys.argv[1])):
    sys.modules[package] = types.ModuleType(package)
    sys.modules[package].__path__ = [path]
import dsinfer.engram.store as store
assert "torch" not in sys.modules
role, name = sys.argv[2], sys.argv[3]

class BlockingSource(store.RandomEngramSource):
    def fill(self, spec, records, progress):
        print(json.dumps({"filling": True}), flush=True)
        time.sleep(3600)

def digest(s):
    out = {}
    for layer in s.layer_ids:
        view = s.region(layer)
        out[str(layer)] = hashlib.sha256(view).hexdigest()
        view.release()
    return out

if role == "load":
    rows = {int(k): v for k, v in json.loads(sys.argv[4]).items()}
    s = store.EngramStore.create(name, store.RandomEngramSource(rows, seed=7), attachers=int(sys.argv[5]))
    print(json.dumps({"ready": True}), flush=True)
elif role == "load-blocking":
    rows = {int(k): v for k, v in json.loads(sys.argv[4]).items()}
    s = store.EngramStore.create(name, BlockingSource(rows), attachers=1)
else:
    try:
        s = store.EngramStore.attach(name, timeout=float(sys.argv[4]))
    except store.EngramStoreError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        sys.exit(3)
    print(json.dumps({"digest": digest(s)}), flush=True)
command = sys.stdin.readline().strip()
if command == "raise":
    raise RuntimeError("helper told to fail")
if command == "hang":
    time.sleep(3600)
s.close()
"""


def _start(role: str, name: str, *args: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ENGRAM_DIR), role, name, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _message(process: subprocess.Popen) -> dict:
    line = process.stdout.readline()
    assert line, f"helper exited early with code {process.wait()}"
    return json.loads(line)


def _finish(process: subprocess.Popen, command: str = "exit") -> int:
    try:
        process.stdin.write(command + "\n")
        process.stdin.flush()
    except BrokenPipeError:
        pass
    return process.wait(timeout=30)


def _segment_exists(name: str) -> bool:
    return (SHM_DIR / name).exists()


def _wait_gone(name: str, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _segment_exists(name):
            return True
        time.sleep(0.02)
    return False


def _expected_digest(source: RandomEngramSource) -> dict[str, str]:
    out = {}
    for layer in source.rows:
        codes, scales = source.expected(layer)
        records = np.concatenate([codes, scales], axis=1)  # the segment's layout
        out[str(layer)] = hashlib.sha256(records.tobytes()).hexdigest()
    return out


@pytest.fixture
def name():
    segment = f"dsinfer-test-{uuid.uuid4().hex[:12]}"
    yield segment
    if _segment_exists(segment):  # a failing test must not leak either
        os.unlink(SHM_DIR / segment)


# ------------------------------------------------------------------------------------------ loading
def _write_checkpoint(directory: Path, rows: dict[int, int], seed: int = 0) -> dict[int, tuple[torch.Tensor, ...]]:
    """Two shards in the official naming (one Engram layer each) plus an index, and the tables they hold."""
    generator = torch.Generator().manual_seed(seed)
    tables, weight_map = {}, {}
    for shard, (layer, n) in enumerate(rows.items()):
        codes = torch.randint(0, 256, (n, 256), dtype=torch.uint8, generator=generator)
        codes[(codes & 0x7F) == 0x7F] ^= 1
        scales = torch.randint(110, 140, (n, 8), dtype=torch.uint8, generator=generator)
        tables[layer] = (codes, scales)
        file = f"model-{shard + 1:05d}-of-{len(rows):05d}.safetensors"
        tensors = {
            f"layers.{layer}.engram.embed.weight": codes.view(torch.float8_e4m3fn),
            f"layers.{layer}.engram.embed.scale": scales.view(torch.float8_e8m0fnu),
            f"layers.{layer}.engram.wkv.weight": torch.zeros(4, 4),
        }
        save_file(tensors, directory / file)
        weight_map.update(dict.fromkeys(tensors, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tables


def test_loads_safetensors_shards_into_one_segment(tmp_path, name):
    tables = _write_checkpoint(tmp_path, ROWS)
    source = SafetensorsEngramSource.from_checkpoint(tmp_path, [1, 14], threads=3)
    assert [(spec.layer_id, spec.rows) for spec in source.table_specs()] == [(1, 3000), (14, 5000)]
    with EngramStore.create(name, source) as store:
        # Alone on the host: the name is dropped as soon as the tables are ready; the mapping lives on.
        assert not _segment_exists(name)
        for layer, (codes, scales) in tables.items():
            assert torch.equal(store.weight(layer), codes)
            assert torch.equal(store.scale(layer), scales)
        assert all(t.offset % (2 << 20) == 0 for t in store.tables.values())
        # Stored as records: each row's 256 codes, then its 8 scale bytes.
        for layer, (codes, scales) in tables.items():
            assert torch.equal(store.records(layer), torch.cat([codes, scales], dim=1))


def test_read_rows_reads_exactly_a_slice_of_a_table(tmp_path):
    """The sharded placement's loader: any row range, from the shards' bytes, without the whole table."""
    tables = _write_checkpoint(tmp_path, ROWS)
    source = SafetensorsEngramSource.from_checkpoint(tmp_path, [1, 14], threads=2)
    for layer, (codes, scales) in tables.items():
        rows = codes.shape[0]
        for start, stop in ((0, rows), (0, 1), (rows - 1, rows), (rows // 3, 2 * rows // 3), (17, 17)):
            weight, scale = source.read_rows(layer, start, stop)
            assert len(weight) == (stop - start) * 256 and len(scale) == (stop - start) * 8
            if stop > start:
                assert torch.equal(torch.frombuffer(weight, dtype=torch.uint8).view(-1, 256), codes[start:stop])
                assert torch.equal(torch.frombuffer(scale, dtype=torch.uint8).view(-1, 8), scales[start:stop])
    with pytest.raises(EngramStoreError, match=r"rows \[0, 3001\) lie outside layer 1's table of 3000 rows"):
        source.read_rows(1, 0, 3001)


def test_close_leaves_the_mapping_to_tensors_still_viewing_it(name):
    """Unmapping under a live tensor would make its next read a segmentation fault; the last one to go unmaps, though
    the closed store itself is still referred to."""
    store = EngramStore.create(name, RandomEngramSource(ROWS))
    weight = store.weight(1)
    expected = weight[:8].clone()
    store.close()
    assert torch.equal(weight[:8], expected) and maps_segment(store)
    del weight
    assert not maps_segment(store)
    with EngramStore.create(name, RandomEngramSource(ROWS)) as second:
        second.weight(1)  # dropped at once: nothing holds the mapping
    assert not maps_segment(second)


def test_safetensors_problems_name_the_file_and_tensor(tmp_path):
    _write_checkpoint(tmp_path, {1: 64})
    shard = next(tmp_path.glob("*.safetensors"))
    with pytest.raises(EngramStoreError, match=r"layers\.14\.engram\.embed\.weight.*not found"):
        SafetensorsEngramSource.from_checkpoint(tmp_path, [1, 14])
    save_file(
        {
            "layers.1.engram.embed.weight": torch.zeros(64, 256, dtype=torch.uint8).view(torch.float8_e4m3fn),
            "layers.1.engram.embed.scale": torch.zeros(64, 4, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        },
        shard,
    )
    with pytest.raises(EngramStoreError, match=rf"{shard.name}.*embed\.scale has shape \[64, 4\], expected \[64, 8\]"):
        SafetensorsEngramSource([shard], [1])
    save_file(
        {"layers.1.engram.embed.weight": torch.zeros(64, 256), "layers.1.engram.embed.scale": torch.zeros(64, 8)}, shard
    )
    with pytest.raises(EngramStoreError, match=r"embed\.weight has dtype F32"):
        SafetensorsEngramSource([shard], [1])


def test_memory_check_names_bytes_needed_and_available(monkeypatch, name):
    monkeypatch.setattr(store_memory, "available_shared_memory", lambda directory, huge: (123_456, "test limit"))
    with pytest.raises(EngramMemoryError) as error:
        EngramStore.create(name, RandomEngramSource(ROWS))
    message = str(error.value)
    needed = segment_bytes(RandomEngramSource(ROWS).table_specs())
    assert f"need {needed:,} bytes" in message and "only 123,456 bytes" in message and "test limit" in message
    assert not _segment_exists(name)


def test_huge_pages_fall_back_with_a_reason(monkeypatch, tmp_path, caplog, name):
    monkeypatch.setenv(HUGETLBFS_ENV, str(tmp_path))  # a directory, but no hugetlbfs
    with caplog.at_level(logging.WARNING, logger="dsinfer.engram.store"):
        store = EngramStore.create(name, RandomEngramSource({1: 100}), huge_pages=True)
    with store:
        assert not store.huge_pages and store.page_size == 4096
        assert store.huge_pages_fallback == f"{tmp_path} is not a mounted hugetlbfs"
    assert f"huge pages requested but {tmp_path} is not a mounted hugetlbfs; falling back to 4 KiB pages" in caplog.text


# ------------------------------------------------------------------------------------------ two processes
def test_second_process_attaches_reads_the_same_bytes_and_nothing_is_left(name):
    source = RandomEngramSource(ROWS, seed=7)
    loader = EngramStore.create(name, source, attachers=1)
    assert _segment_exists(name)  # waits for its one attacher
    attacher = _start("attach", name, 10)
    assert _message(attacher)["digest"] == _expected_digest(source)
    assert not _segment_exists(name)  # the last attacher removed the name; both still map the memory
    assert torch.equal(loader.weight(14)[-1], torch.from_numpy(source.expected(14)[0][-1]))
    assert _finish(attacher) == 0
    loader.close()
    assert not _segment_exists(name)


def test_loader_exception_reaches_the_waiting_rank(name):
    class Broken(RandomEngramSource):
        def fill(self, spec, records, progress):
            time.sleep(0.5)  # the waiting rank finds the segment while it is loading
            raise OSError("disk on fire")

    attacher = _start("attach", name, 20)
    time.sleep(0.2)  # let it start polling before the segment exists
    with pytest.raises(OSError, match="disk on fire"):
        EngramStore.create(name, Broken(ROWS), attachers=1)
    assert not _segment_exists(name)
    reply = _message(attacher)
    assert attacher.wait(timeout=30) == 3
    assert "failed to load" in reply["error"] and "OSError: disk on fire" in reply["error"]


def test_attacher_exception_after_attach_leaves_nothing(name):
    loader = EngramStore.create(name, RandomEngramSource(ROWS, seed=7), attachers=1)
    attacher = _start("attach", name, 10)
    _message(attacher)
    assert _finish(attacher, "raise") != 0
    loader.close()
    assert not _segment_exists(name)


def test_sigkilled_loader_segment_is_reaped(name):
    loader = _start("load", name, json.dumps(ROWS), 1)
    assert _message(loader)["ready"]
    assert _segment_exists(name)  # its attacher has not come yet
    loader.send_signal(signal.SIGKILL)
    loader.wait(timeout=30)
    assert _wait_gone(name), "the reaper did not remove the segment of a SIGKILLed loader"
    with pytest.raises(EngramStoreError, match="to appear"):
        EngramStore.attach(name, timeout=0.2)


def test_sigkilled_loader_while_loading_fails_the_waiting_rank(name):
    loader = _start("load-blocking", name, json.dumps(ROWS))
    assert _message(loader)["filling"]
    outcome: dict[str, BaseException] = {}

    def attach() -> None:
        try:
            EngramStore.attach(name, timeout=60)
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            outcome["error"] = exc

    waiter = threading.Thread(target=attach)
    waiter.start()
    time.sleep(0.2)
    started = time.monotonic()
    loader.send_signal(signal.SIGKILL)
    loader.wait(timeout=30)
    waiter.join(timeout=30)
    assert time.monotonic() - started < 10
    assert isinstance(outcome.get("error"), EngramStoreError)
    assert "died while loading" in str(outcome["error"])
    assert _wait_gone(name)


def test_sigkilled_attacher_then_loader_exit_leaves_nothing(name):
    loader = EngramStore.create(name, RandomEngramSource(ROWS), attachers=2)
    attacher = _start("attach", name, 10)
    _message(attacher)
    attacher.send_signal(signal.SIGKILL)
    attacher.wait(timeout=30)
    assert _segment_exists(name)  # one of two attachers came: the name waits for the other
    loader.close()
    assert not _segment_exists(name)


def test_stale_segment_of_a_dead_loader_is_replaced_and_removable(name, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    header = SegmentHeader(0, dead.pid, 1, 0, 0, 0, 4096, 4096, 0, 0, 0, "", [])
    with open(SHM_DIR / name, "wb") as handle:
        handle.truncate(4096)
    with open(SHM_DIR / name, "r+b") as handle:
        with mmap.mmap(handle.fileno(), 4096) as mapping:
            header.write(mapping)
    os.utime(SHM_DIR / name, (time.time() - 60, time.time() - 60))
    assert SHM_DIR / name in remove_stale_segments([SHM_DIR])
    assert not _segment_exists(name)
    (SHM_DIR / name).write_bytes(b"")  # a header-less leftover, old enough to be stale
    os.utime(SHM_DIR / name, (time.time() - 60, time.time() - 60))
    with caplog.at_level(logging.WARNING, logger="dsinfer.engram.store"):
        with EngramStore.create(name, RandomEngramSource({1: 10})) as store:
            assert store.tables[1].rows == 10
    assert "removing stale segment" in caplog.text


def test_attach_timeout_is_clear(name):
    pattern = rf"timed out after 0 s waiting for the Engram segment .*{name}.*to appear"
    with pytest.raises(EngramStoreError, match=pattern):
        EngramStore.attach(name, timeout=0.1)
