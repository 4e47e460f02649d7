"""Where a loader gets Engram table bytes from: checkpoint shards, or random tables for tests and benchmarks.

A source plans from metadata alone (:meth:`EngramSource.table_specs`) and then writes each table's
records straight into the mapped segment (:meth:`EngramSource.fill`), from reader threads.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from dsinfer.engram.store.errors import EngramStoreError
from dsinfer.engram.store.segment import ENGRAM_ROW_BYTES, ENGRAM_SCALE_BLOCK, EngramTableSpec

__all__ = ["EngramSource", "RandomEngramSource", "SafetensorsEngramSource"]


class EngramSource(Protocol):
    """Where a loader gets table bytes from: a checkpoint, or random tables for tests and benchmarks."""

    def table_specs(self) -> list[EngramTableSpec]:
        """The tables, in the order they are laid out."""
        ...

    def fill(self, spec: EngramTableSpec, records: memoryview, progress: Callable[[int], None]):
        """Write the table as ``[rows, record_bytes]`` records into ``records`` (each row's codes, then its
        ue8m0 scale bytes); call ``progress(n)`` after each ``n`` bytes written, from any thread."""
        ...


_SAFETENSORS_DTYPES = {"weight": ("F8_E4M3", "U8", "I8"), "scale": ("F8_E8M0", "U8")}


def _read_safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the offset where its data starts."""
    try:
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise EngramStoreError(f"{path}: too short to be a safetensors file")
            (length,) = struct.unpack("<Q", prefix)
            if length > 100 << 20:
                raise EngramStoreError(f"{path}: safetensors header of {length} bytes is implausible")
            header = json.loads(handle.read(length))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngramStoreError(f"{path}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise EngramStoreError(f"{path}: the safetensors header is not a JSON object")
    return header, 8 + length


@dataclass(frozen=True)
class _TensorExtent:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    nbytes: int


class SafetensorsEngramSource:
    """Engram tables from checkpoint shards: ``[model.]layers.L.engram.embed.{weight,scale}``.

    Reads only the headers to plan (no tensor is materialised), then copies each tensor's bytes
    straight into the mapped segment with ``os.preadv`` from several threads. The safetensors
    format is a length-prefixed JSON header followed by raw little-endian bytes; reading it here
    keeps the loader free of torch and of a second copy of a 100 GB tensor.
    """

    def __init__(self, files: Iterable[str | os.PathLike[str]], layer_ids: Sequence[int], *, threads: int = 8):
        self.files = [Path(f) for f in files]
        if not self.files:
            raise EngramStoreError("no safetensors files given for the Engram tables")
        self.layer_ids = [int(layer) for layer in layer_ids]
        self.threads = max(1, threads)
        self._extents = self._locate()
        self._specs = [self._spec(layer) for layer in self.layer_ids]

    @classmethod
    def from_checkpoint(cls, directory: str | os.PathLike[str], layer_ids: Sequence[int], **kwargs: Any):
        """All ``*.safetensors`` shards of a checkpoint directory (the index file lists them, if present)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise EngramStoreError(f"{directory}: not a directory")
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise EngramStoreError(f"{index}: not a valid safetensors index ({exc})") from None
            files = [directory / name for name in names]
        else:
            files = sorted(directory.glob("*.safetensors"))
        return cls(files, layer_ids, **kwargs)

    def _locate(self) -> dict[str, _TensorExtent]:
        wanted = {}
        for layer in self.layer_ids:
            for kind in ("weight", "scale"):
                wanted[f"layers.{layer}.engram.embed.{kind}"] = None
        found: dict[str, _TensorExtent] = {}
        for path in self.files:
            if not path.is_file():
                raise EngramStoreError(f"{path}: safetensors shard not found")
            header, data_start = _read_safetensors_header(path)
            size = path.stat().st_size
            for raw_name, entry in header.items():
                name = raw_name.removeprefix("model.")
                if name not in wanted:
                    continue
                try:
                    begin, end = (int(x) for x in entry["data_offsets"])
                    dtype, shape = str(entry["dtype"]), tuple(int(d) for d in entry["shape"])
                except (KeyError, TypeError, ValueError):
                    raise EngramStoreError(f"{path}: malformed header entry for {raw_name}") from None
                if data_start + end > size or begin > end:
                    raise EngramStoreError(
                        f"{path}: tensor {raw_name} ends at byte {data_start + end} but the file has {size} bytes "
                        "(truncated shard?)"
                    )
                found[name] = _TensorExtent(path, dtype, shape, data_start + begin, end - begin)
        missing = [name for name in wanted if name not in found]
        if missing:
            raise EngramStoreError(
                f"Engram tensors {missing} not found in {len(self.files)} safetensors file(s) "
                f"({', '.join(str(p) for p in self.files[:3])}{', ...' if len(self.files) > 3 else ''})"
            )
        return found

    def _spec(self, layer: int) -> EngramTableSpec:
        weight = self._extents[f"layers.{layer}.engram.embed.weight"]
        scale = self._extents[f"layers.{layer}.engram.embed.scale"]
        for kind, extent in (("weight", weight), ("scale", scale)):
            if extent.dtype not in _SAFETENSORS_DTYPES[kind]:
                raise EngramStoreError(
                    f"{extent.path}: layers.{layer}.engram.embed.{kind} has dtype {extent.dtype}, expected one of "
                    f"{_SAFETENSORS_DTYPES[kind]}"
                )
            if len(extent.shape) != 2 or extent.nbytes != extent.shape[0] * extent.shape[1]:
                raise EngramStoreError(
                    f"{extent.path}: layers.{layer}.engram.embed.{kind} has shape {list(extent.shape)} and "
                    f"{extent.nbytes} bytes; expected a 2-D table of one byte per element"
                )
        rows, row_bytes = weight.shape
        if row_bytes <= 0 or row_bytes % ENGRAM_SCALE_BLOCK:  # the release has 256; tiny test models fewer
            raise EngramStoreError(
                f"{weight.path}: layers.{layer}.engram.embed.weight has {row_bytes} columns, expected a positive "
                f"multiple of {ENGRAM_SCALE_BLOCK} ({ENGRAM_ROW_BYTES} in the release)"
            )
        expected_scale = (rows, row_bytes // ENGRAM_SCALE_BLOCK)
        if scale.shape != expected_scale:
            raise EngramStoreError(
                f"{scale.path}: layers.{layer}.engram.embed.scale has shape {list(scale.shape)}, expected "
                f"{list(expected_scale)} (one ue8m0 scale per {ENGRAM_SCALE_BLOCK} channels of each row)"
            )
        return EngramTableSpec(layer, rows, row_bytes, expected_scale[1])

    def table_specs(self) -> list[EngramTableSpec]:
        return list(self._specs)

    def fill(self, spec: EngramTableSpec, records: memoryview, progress: Callable[[int], None]):
        """Read the two tensors a chunk of rows at a time (threads in parallel) and interleave them into records."""
        import numpy as np

        table = np.frombuffer(records, dtype=np.uint8).reshape(spec.rows, spec.record_bytes)
        chunk_rows = max(1, (64 << 20) // spec.row_bytes)

        def load(start: int) -> None:
            stop = min(start + chunk_rows, spec.rows)
            weight = bytearray((stop - start) * spec.row_bytes)
            scale = bytearray((stop - start) * spec.scale_columns)
            for path, file_offset, target in self._row_reads(spec.layer_id, start, stop, weight, scale, len(weight)):
                _read_exactly(path, file_offset, target)
            table[start:stop, : spec.row_bytes] = np.frombuffer(weight, dtype=np.uint8).reshape(-1, spec.row_bytes)
            table[start:stop, spec.row_bytes :] = np.frombuffer(scale, dtype=np.uint8).reshape(-1, spec.scale_columns)
            progress((stop - start) * spec.record_bytes)

        try:
            with ThreadPoolExecutor(max_workers=self.threads) as pool:
                for _ in pool.map(load, range(0, spec.rows, chunk_rows)):
                    pass
        finally:
            table = None  # drop the export of ``records`` before the caller releases it

    def read_rows(self, layer_id: int, start: int, stop: int) -> tuple[bytearray, bytearray]:
        """The raw bytes of rows ``[start, stop)`` of ``layer_id``'s table: (FP8 codes, ue8m0 scales).

        Rows are contiguous in the shard, so this reads just that byte range of each tensor (the
        ``sharded`` placement loads a rank's slice this way, never the whole table).
        """
        spec = self._specs[self.layer_ids.index(layer_id)]
        if not 0 <= start <= stop <= spec.rows:
            raise EngramStoreError(f"rows [{start}, {stop}) lie outside layer {layer_id}'s table of {spec.rows} rows")
        weight = bytearray((stop - start) * spec.row_bytes)
        scale = bytearray((stop - start) * spec.scale_columns)
        jobs = self._row_reads(layer_id, start, stop, weight, scale, 64 << 20)
        with ThreadPoolExecutor(max_workers=self.threads) as pool:
            for _ in pool.map(lambda job: _read_exactly(*job), jobs):
                pass
        return weight, scale

    def _row_reads(
        self, layer_id: int, start: int, stop: int, weight: bytearray, scale: bytearray, chunk: int
    ) -> list[tuple[Path, int, memoryview]]:
        """``(file, offset, target)`` reads of at most ``chunk`` bytes that put rows ``[start, stop)`` of the
        layer's weight and scale tensors into ``weight`` / ``scale``."""
        jobs = []
        for kind, target in (("weight", memoryview(weight)), ("scale", memoryview(scale))):
            extent = self._extents[f"layers.{layer_id}.engram.embed.{kind}"]
            row_bytes = extent.shape[1]
            first, nbytes = extent.start + start * row_bytes, (stop - start) * row_bytes
            for offset in range(0, nbytes, chunk):
                jobs.append((extent.path, first + offset, target[offset : min(offset + chunk, nbytes)]))
        return jobs


def _read_exactly(path: Path, file_offset: int, target: memoryview) -> None:
    """Fill ``target`` with the bytes of ``path`` from ``file_offset`` on (an error at a short file)."""
    size = len(target)
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < size:
            n = os.preadv(fd, [target[done:]], file_offset + done)
            if n == 0:
                raise EngramStoreError(f"{path}: unexpected end of file at byte {file_offset + done}")
            done += n
    finally:
        os.close(fd)
        target.release()


class RandomEngramSource:
    """Deterministic random tables (``numpy`` PCG64): FP8 codes without NaN, scales in a sane range.

    For tests and benchmarks. ``tile_rows`` repeats one random block of that many rows over the
    table, which fills a 64 GiB benchmark table at memory speed; tests leave it ``None`` so every
    row differs. :meth:`expected` returns the same bytes as numpy arrays.
    """

    def __init__(
        self,
        rows: Mapping[int, int],
        *,
        seed: int = 0,
        tile_rows: int | None = None,
        scale_exponents: tuple[int, int] = (112, 135),
    ):
        self.rows = {int(layer): int(n) for layer, n in rows.items()}
        self.seed = seed
        self.tile_rows = tile_rows
        self.scale_exponents = scale_exponents
        self._chunk_rows = tile_rows or (1 << 16)

    def table_specs(self) -> list[EngramTableSpec]:
        return [EngramTableSpec(layer, rows) for layer, rows in self.rows.items()]

    def _block(self, layer: int, block: int, rows: int):
        import numpy as np

        rng = np.random.default_rng((self.seed, layer, block))
        codes = rng.integers(0, 256, size=(rows, ENGRAM_ROW_BYTES), dtype=np.uint8)
        codes[(codes & 0x7F) == 0x7F] ^= 1  # 0x7f / 0xff are NaN in e4m3fn: step to the neighbouring code
        low, high = self.scale_exponents
        scales = rng.integers(low, high + 1, size=(rows, ENGRAM_ROW_BYTES // ENGRAM_SCALE_BLOCK), dtype=np.uint8)
        return codes, scales

    def fill(self, spec: EngramTableSpec, records: memoryview, progress: Callable[[int], None]):
        import numpy as np

        table = np.frombuffer(records, dtype=np.uint8).reshape(spec.rows, spec.record_bytes)
        weight_rows, scale_rows = table[:, : spec.row_bytes], table[:, spec.row_bytes :]
        tile = self._block(spec.layer_id, 0, self._chunk_rows) if self.tile_rows else None
        for block, start in enumerate(range(0, spec.rows, self._chunk_rows)):
            stop = min(start + self._chunk_rows, spec.rows)
            codes, scales = tile if tile is not None else self._block(spec.layer_id, block, self._chunk_rows)
            weight_rows[start:stop] = codes[: stop - start]
            scale_rows[start:stop] = scales[: stop - start]
            progress((stop - start) * spec.record_bytes)
        del table, weight_rows, scale_rows

    def expected(self, layer: int):
        """``(codes [rows, 256], scales [rows, 8])`` uint8 numpy arrays of one table."""
        import numpy as np

        spec = next(s for s in self.table_specs() if s.layer_id == layer)
        records = np.empty((spec.rows, spec.record_bytes), dtype=np.uint8)
        self.fill(spec, memoryview(records).cast("B"), lambda n: None)
        return records[:, : spec.row_bytes].copy(), records[:, spec.row_bytes :].copy()
