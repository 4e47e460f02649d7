"""The grading step: judge saved generations, write ``grades-<judge>.jsonl`` and ``summary.json``.

Grading never touches ``generations.jsonl`` (read-only here), so it can be rerun with another judge at any
time. Rule grading is recomputed from scratch each time (it is cheap and deterministic). LLM grading appends
each verdict durably as it arrives and, on a rerun, keeps the saved verdicts of the same judge model for the
same responses and asks again only for what is missing or ended in a judge error.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from dsinfer.eval.backends import run_concurrently
from dsinfer.eval.datasets import BENCHMARKS, EvalError
from dsinfer.eval.generate import GENERATIONS_FILE, is_finished, load_generations, read_manifest
from dsinfer.eval.judges import Verdict, fingerprint, require_rule_judge, rule_judge
from dsinfer.eval.records import (
    append_record,
    latest_by_key,
    open_for_append,
    read_records,
    record_key,
    write_atomically,
    write_json,
)

JUDGES = ("rule", "llm")
SUMMARY_FILE = "summary.json"
#: The judge used when ``--judge`` is not given: the deterministic rule judge where one exists.
DEFAULT_JUDGE = {"aime": "rule", "gpqa": "rule", "hle": "llm"}
SETTINGS_IN_SUMMARY = ("temperature", "top_p", "max_tokens", "reasoning_effort", "seed", "backend", "base_url", "data",
                       "data_sha256")  # fmt: skip


def grades_file(judge_name: str) -> str:
    return f"grades-{judge_name}.jsonl"


def grade_run(
    out_dir: str | Path, judge_name: str, llm_judge=None, *, concurrency: int = 16, progress: bool = True
) -> dict[str, Any]:
    """Grade every saved generation of ``out_dir`` with ``judge_name``; returns (and writes) the summary."""
    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    benchmark = manifest.get("benchmark")
    if benchmark not in BENCHMARKS:
        raise EvalError(f"{out_dir / 'run.json'}: unknown benchmark {benchmark!r}")
    if judge_name not in JUDGES:
        raise EvalError(f"unknown judge {judge_name!r}: expected one of {', '.join(JUDGES)}")
    if judge_name == "rule":
        require_rule_judge(benchmark)
    if judge_name == "llm" and llm_judge is None:
        raise EvalError("--judge llm needs a judge endpoint: pass --judge-base-url (and --judge-model)")
    if not (out_dir / GENERATIONS_FILE).exists():
        raise EvalError(f"{out_dir / GENERATIONS_FILE} does not exist; run 'dsinfer eval run' first")

    expected = _expected_keys(manifest)
    generations, _ = load_generations(out_dir)
    records = [generations[key] for key in expected if key in generations]
    path = out_dir / grades_file(judge_name)
    if judge_name == "rule":
        grades = {record_key(r): _grade_record(r, "rule", None, _rule_verdict(benchmark, r)) for r in records}
        write_atomically(path, [grades[key] for key in expected if key in grades])
        judge_model = None
    else:
        grades = _llm_grades(path, records, llm_judge, concurrency, progress)
        judge_model = llm_judge.model
    summary = summarize(manifest, expected, grades, judge_name, judge_model)
    summary["grades_file"] = path.name
    write_json(out_dir / SUMMARY_FILE, summary)
    return summary


def _expected_keys(manifest: dict[str, Any]) -> list[tuple[str, int]]:
    samples = int(manifest["samples"])
    return [(str(qid), s) for qid in manifest["question_ids"] for s in range(samples)]


def _rule_verdict(benchmark: str, record: dict[str, Any]) -> Verdict | None:
    return None if record.get("error") else rule_judge(benchmark, record.get("response"), str(record["reference"]))


def _grade_record(record: dict[str, Any], judge_name: str, judge_model: str | None, verdict: Verdict | None) -> dict:
    """One grade line. A generation that failed is not judged: it is incorrect and carries its error."""
    grade: dict[str, Any] = {
        "id": record["id"],
        "sample": record["sample"],
        "judge": judge_name,
        "correct": bool(verdict and verdict.correct),
        "extracted": verdict.extracted if verdict else None,
        "reference": record["reference"],
        "finish_reason": record.get("finish_reason"),
        "error": record.get("error"),
        "judge_error": verdict.judge_error if verdict else None,
    }
    if judge_name == "llm":
        grade.update(judge_model=judge_model, judge_raw=verdict.judge_raw if verdict else None,
                     fingerprint=fingerprint(record))  # fmt: skip
    return grade


def _llm_grades(path: Path, records: list[dict], judge, concurrency: int, progress: bool) -> dict:
    """Saved verdicts of this judge model for these very responses, plus new ones for the rest."""
    by_key = {record_key(r): r for r in records}
    saved, _ = read_records(path)

    def reusable(grade: dict[str, Any]) -> bool:
        record = by_key.get(record_key(grade))
        if record is None or grade.get("judge_error") or grade.get("error"):
            return False
        return grade.get("judge_model") == judge.model and grade.get("fingerprint") == fingerprint(record)

    grades = {key: g for key, g in latest_by_key(saved, reusable).items() if reusable(g)}
    handle = open_for_append(path, list(grades.values()), rewrite=True)
    todo = [r for r in records if record_key(r) not in grades]
    bar = tqdm(total=len(records), initial=len(records) - len(todo), desc="llm judge", unit="sample",
               disable=not progress)  # fmt: skip

    def judge_one(record: dict[str, Any]) -> dict:
        verdict = judge.judge(record) if is_finished(record) else None
        return _grade_record(record, "llm", judge.model, verdict)

    def save(_record: dict[str, Any], grade: dict[str, Any]) -> None:
        append_record(handle, grade)
        grades[record_key(grade)] = grade
        bar.update(1)

    try:
        run_concurrently(todo, judge_one, concurrency, save)
    finally:
        bar.close()
        handle.close()
    write_atomically(path, [grades[record_key(r)] for r in records])  # the same lines, in question order
    return grades


def summarize(
    manifest: dict[str, Any],
    expected: list[tuple[str, int]],
    grades: dict[tuple[str, int], dict],
    judge_name: str,
    judge_model: str | None,
) -> dict[str, Any]:
    """pass@1 = mean over questions of (correct samples / K); missing or failed samples count as incorrect, and
    the number is valid only when ``coverage_complete`` (every question has K graded samples, none errored)."""
    samples = int(manifest["samples"])
    per_question = []
    for qid in manifest["question_ids"]:
        present = [grades[(str(qid), s)] for s in range(samples) if (str(qid), s) in grades]
        correct = sum(g["correct"] for g in present)
        per_question.append({
            "id": str(qid),
            "samples": len(present),
            "correct": correct,
            "pass_at_1": correct / samples,
            "truncated": sum(g.get("finish_reason") == "length" for g in present),
            "errors": sum(bool(g.get("error") or g.get("judge_error")) for g in present),
        })  # fmt: skip
    present = [grades[key] for key in expected if key in grades]
    image_ids = {str(qid) for qid in manifest.get("image_question_ids", [])}
    generation_errors = sum(bool(g.get("error")) for g in present)
    judge_errors = sum(bool(g.get("judge_error")) for g in present)
    missing = len(expected) - len(present)
    graded = len(present) - generation_errors - judge_errors
    correct = sum(g["correct"] for g in present)
    return {
        "benchmark": manifest["benchmark"],
        "model": manifest.get("model"),
        "judge": judge_name,
        "judge_model": judge_model,
        "questions": len(manifest["question_ids"]),
        "samples_per_question": samples,
        "expected_samples": len(expected),
        "graded_samples": graded,
        "correct_samples": correct,
        "pass_at_1": sum(q["pass_at_1"] for q in per_question) / max(len(per_question), 1),
        "accuracy_over_graded": correct / graded if graded else None,
        "truncated": sum(g.get("finish_reason") == "length" for g in present),
        "no_answer": sum(judge_name == "rule" and not g.get("error") and g.get("extracted") is None for g in present),
        "generation_errors": generation_errors,
        "judge_errors": judge_errors,
        "errors": generation_errors + judge_errors,
        "missing": missing,
        "coverage_complete": missing == 0 and generation_errors == 0 and judge_errors == 0,
        "image_questions": len(image_ids),
        "image_questions_covered": sum(
            q["id"] in image_ids and q["samples"] == samples and not q["errors"] for q in per_question
        ),  # fmt: skip
        "settings": {name: manifest.get(name) for name in SETTINGS_IN_SUMMARY},
        "graded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "per_question": per_question,
    }
