"""Crash-safe JSONL record files: append + flush + fsync per record, and a tolerant, deduplicating reader.

A record is durable once its line, newline included, is on disk. A crash can therefore leave at most one torn
line at the end of the file: the reader ignores any last line without its newline (even one that parses, since
its write may not be complete), and :func:`open_for_append` rewrites the file without it before appending, so
a new record never glues onto a fragment. A broken line *before* the end is not a crash artefact; it is
reported with its line number rather than silently dropped.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from dsinfer.eval.datasets import EvalError

Key = tuple[str, int]


def record_key(record: dict[str, Any]) -> Key:
    return (str(record["id"]), int(record["sample"]))


def read_records(path: Path) -> tuple[list[dict[str, Any]], bool]:
    """All complete records in file order, and whether a torn last line was dropped. A missing file is empty."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], False
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline, else the torn last line
    torn = tail.strip() != b""
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record_key(record)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
            raise EvalError(f"{path}:{number}: not a valid record ({exc}); fix or remove the line") from None
        records.append(record)
    return records, torn


def latest_by_key(records: Iterable[dict[str, Any]], keep: Callable[[dict[str, Any]], bool]) -> dict[Key, dict]:
    """One record per (id, sample): the first one that ``keep`` accepts, else the last one seen."""
    chosen: dict[Key, dict[str, Any]] = {}
    for record in records:
        key = record_key(record)
        if key not in chosen or not keep(chosen[key]):
            chosen[key] = record
    return chosen


def write_atomically(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Replace ``path`` with exactly ``records`` (temp file, fsync, rename): a crash leaves old or new, not half."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(encode(record))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_directory(path.parent)


def open_for_append(path: Path, records: list[dict[str, Any]], rewrite: bool) -> IO[str]:
    """Open ``path`` for appending after making it hold exactly ``records`` (rewritten only when ``rewrite``)."""
    if rewrite or not path.exists():
        write_atomically(path, records)
    return path.open("a", encoding="utf-8")


def append_record(handle: IO[str], record: dict[str, Any]) -> None:
    """Append one record durably: one write of the whole line, then flush and fsync."""
    handle.write(encode(record))
    handle.flush()
    os.fsync(handle.fileno())


def encode(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, sort_keys=False) + "\n"


def write_json(path: Path, value: Any) -> None:
    """A small JSON document (run.json, summary.json), replaced atomically."""
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("w", encoding="utf-8") as handle:
        handle.write(json.dumps(value, ensure_ascii=False, indent=2) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
