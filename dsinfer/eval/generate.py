"""The generation step: every (question, sample) once, one durable JSONL line each, resumable.

``DIR/run.json`` records what the run is (benchmark, dataset hash, model, sampling settings, prompt version,
question ids, samples per question). A rerun into the same directory must ask for the same thing (only the
number of samples, the concurrency and where the model is served may change); it then loads
``generations.jsonl``, keeps one finished record per (id, sample), drops errored records and a torn last line
(rewriting the file when it drops anything), and generates only what is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dsinfer.eval.backends import GenerationOptions
from dsinfer.eval.datasets import (
    PROMPT_VERSION,
    EvalError,
    SampleRequest,
    build_requests,
    file_sha256,
    load_dataset,
    recorded_messages,
)
from dsinfer.eval.records import append_record, latest_by_key, open_for_append, read_records, record_key, write_json

GENERATIONS_FILE = "generations.jsonl"
RUN_FILE = "run.json"
LOCK_FILE = ".lock"
#: run.json fields a rerun must match: changing any of them would mix two different experiments in one file.
SETTINGS_THAT_MUST_MATCH = (
    "benchmark", "data_sha256", "model", "temperature", "top_p", "max_tokens", "reasoning_effort", "seed",
    "prompt_version",
)  # fmt: skip


@dataclass(frozen=True)
class GenerationRun:
    benchmark: str
    data: Path
    samples: int
    options: GenerationOptions
    seed: int = 0
    concurrency: int = 16
    limit: int | None = None  # only the first N questions (quick checks)


@dataclass
class GenerationReport:
    total: int
    reused: int
    generated: int
    errors: int
    out_dir: Path


def is_finished(record: dict[str, Any]) -> bool:
    """A record a rerun keeps: it has a response and no error."""
    return not record.get("error")


def load_generations(out_dir: Path) -> tuple[dict[tuple[str, int], dict], bool]:
    """One record per (id, sample) (a finished one when there is one), and whether the file needs rewriting."""
    records, torn = read_records(out_dir / GENERATIONS_FILE)
    chosen = latest_by_key(records, is_finished)
    return chosen, torn or len(chosen) != len(records)


def read_manifest(out_dir: Path) -> dict[str, Any]:
    path = out_dir / RUN_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EvalError(f"{out_dir} is not an eval run directory: {RUN_FILE} is missing") from None
    except json.JSONDecodeError as exc:
        raise EvalError(f"{path}: not valid JSON ({exc.msg})") from None


def run_generation(
    run: GenerationRun,
    backend,
    out_dir: str | Path,
    *,
    progress: bool = True,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> GenerationReport:
    """Generate what ``out_dir`` is missing; ``on_record`` sees each record after it is on disk (tests use it)."""
    questions = load_dataset(run.benchmark, run.data)
    if run.limit is not None:
        questions = questions[: run.limit]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with lock_run_directory(out_dir):
        return _generate(run, backend, out_dir, questions, progress, on_record)


def _generate(run: GenerationRun, backend, out_dir: Path, questions, progress: bool, on_record) -> GenerationReport:
    manifest = _manifest(run, backend, [q.id for q in questions])
    manifest["image_question_ids"] = [q.id for q in questions if q.image is not None]  # HLE: counted in coverage
    _check_manifest(out_dir, manifest)

    existing, needs_rewrite = load_generations(out_dir)
    requests = build_requests(run.benchmark, questions, run.samples, run.seed)
    wanted = {r.key for r in requests}
    kept = [record for key, record in existing.items() if is_finished(record)]
    # Errored records are dropped here and regenerated: a rerun is how a transient failure gets retried.
    needs_rewrite = needs_rewrite or len(kept) != len(existing)
    done = {record_key(record) for record in kept}
    todo = [r for r in requests if r.key not in done]
    write_json(out_dir / RUN_FILE, manifest)

    errors = 0
    handle = open_for_append(out_dir / GENERATIONS_FILE, kept, rewrite=needs_rewrite)
    bar = tqdm(total=len(requests), initial=len(wanted & done), desc=f"{run.benchmark} generate", unit="sample",
               disable=not progress)  # fmt: skip
    try:

        def write(request: SampleRequest, result: dict[str, Any]) -> None:
            nonlocal errors
            record = _record(run, backend, request, result)
            append_record(handle, record)
            errors += bool(record["error"])
            bar.update(1)
            if on_record is not None:
                on_record(record)

        if todo:
            backend.run(todo, run.options, run.concurrency, write)
    finally:
        bar.close()
        handle.close()
    return GenerationReport(len(requests), len(wanted & done), len(todo), errors, out_dir)


@contextlib.contextmanager
def lock_run_directory(out_dir: Path):
    """One writer per run directory: two concurrent runs would generate (and append) the same samples twice."""
    with (out_dir / LOCK_FILE).open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise EvalError(f"another 'dsinfer eval run' is writing to {out_dir}") from None
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _record(run: GenerationRun, backend, request: SampleRequest, result: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {
        "id": request.question_id,
        "sample": request.sample,
        "benchmark": run.benchmark,
        "model": backend.describe()["model"],
        "seed": request.seed,
        "prompt": recorded_messages(request.messages),
        "reference": request.reference,
        **request.extra,
        "response": result["response"],
        "reasoning": result["reasoning"],
        "finish_reason": result["finish_reason"],
        "usage": result["usage"],
        "error": result["error"],
        "timing": result.get("timing"),
    }
    return record


def _manifest(run: GenerationRun, backend, question_ids: list[str]) -> dict[str, Any]:
    described = backend.describe()
    return {
        "benchmark": run.benchmark,
        "data": str(Path(run.data).resolve()),
        "data_sha256": file_sha256(run.data),
        "question_ids": question_ids,
        "samples": run.samples,
        "model": described["model"],
        "backend": described["backend"],
        "base_url": described["base_url"],
        "temperature": run.options.temperature,
        "top_p": run.options.top_p,
        "max_tokens": run.options.max_tokens,
        "reasoning_effort": run.options.reasoning_effort,
        "seed": run.seed,
        "prompt_version": PROMPT_VERSION,
        "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _check_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    """Refuse to resume a directory made with different settings (its samples would not be comparable)."""
    if not (out_dir / RUN_FILE).exists():
        if (out_dir / GENERATIONS_FILE).exists():
            raise EvalError(f"{out_dir} holds {GENERATIONS_FILE} but no {RUN_FILE}; use a fresh --out directory")
        return
    previous = read_manifest(out_dir)
    for name in SETTINGS_THAT_MUST_MATCH:
        if previous.get(name) != manifest[name]:
            raise EvalError(
                f"{out_dir / RUN_FILE} was made with {name}={previous.get(name)!r}, this run asks for "
                f"{name}={manifest[name]!r}; use another --out directory so the two runs are not mixed"
            )
    if previous.get("question_ids") != manifest["question_ids"]:
        raise EvalError(
            f"{out_dir / RUN_FILE} covers other questions (a different --limit?); use another --out directory"
        )
