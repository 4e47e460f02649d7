"""Grading bookkeeping on hand-written run directories: pass@1, coverage, error and truncation counts, and
the LLM judge's reuse of saved verdicts (the real LLM judge runs against our server in the end-to-end test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsinfer.eval.datasets import EvalError
from dsinfer.eval.grade import grade_run
from dsinfer.eval.judges import Verdict


def write_run(directory: Path, benchmark: str, question_ids: list[str], samples: int, records: list[dict]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {"benchmark": benchmark, "question_ids": question_ids, "samples": samples, "model": "m"}
    (directory / "run.json").write_text(json.dumps(manifest))
    with (directory / "generations.jsonl").open("w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return directory


def generation(qid: str, sample: int, response: str | None, reference: str, *, finish="stop", error=None) -> dict:
    return {"id": qid, "sample": sample, "benchmark": "aime", "prompt": [{"role": "user", "content": f"{qid}?"}],
            "reference": reference, "response": response, "reasoning": None, "finish_reason": finish,
            "usage": None, "error": error}  # fmt: skip


def partial_aime_records() -> list[dict]:
    return [
        generation("q1", 0, r"\boxed{42}", "42"),
        generation("q1", 1, r"\boxed{41}", "42"),
        generation("q2", 0, "The answer is 24.", "24"),
        generation("q2", 1, None, "24", finish=None, error="APIConnectionError: Connection error."),
        generation("q3", 0, "", "7", finish="length"),  # cut off: graded, no answer
        # ("q3", 1) is missing
    ]


def test_summary_counts_and_pass_at_1_over_k(tmp_path):
    run = write_run(tmp_path / "run", "aime", ["q1", "q2", "q3"], 2, partial_aime_records())
    summary = grade_run(run, "rule", progress=False)
    assert summary == json.loads((run / "summary.json").read_text())
    assert summary["pass_at_1"] == pytest.approx((0.5 + 0.5 + 0.0) / 3)  # failed and missing samples count as wrong
    assert summary["correct_samples"] == 2 and summary["graded_samples"] == 4
    assert summary["accuracy_over_graded"] == pytest.approx(0.5)
    assert (summary["generation_errors"], summary["judge_errors"], summary["errors"]) == (1, 0, 1)
    assert (summary["missing"], summary["truncated"], summary["no_answer"]) == (1, 1, 1)
    assert summary["coverage_complete"] is False
    rows = {row["id"]: row for row in summary["per_question"]}
    assert rows["q2"] == {"id": "q2", "samples": 2, "correct": 1, "pass_at_1": 0.5, "truncated": 0, "errors": 1}
    assert rows["q3"]["samples"] == 1 and rows["q3"]["truncated"] == 1
    grades = [json.loads(line) for line in (run / "grades-rule.jsonl").read_text().splitlines()]
    assert [(g["id"], g["sample"]) for g in grades] == [("q1", 0), ("q1", 1), ("q2", 0), ("q2", 1), ("q3", 0)]
    assert grades[1]["extracted"] == "41" and not grades[1]["correct"]
    assert grades[3]["error"].startswith("APIConnectionError") and grades[3]["extracted"] is None


def test_coverage_is_complete_only_with_every_sample_graded(tmp_path):
    records = [generation(q, s, r"\boxed{7}", "7") for q in ("q1", "q2") for s in range(3)]
    run = write_run(tmp_path / "run", "aime", ["q1", "q2"], 3, records)
    summary = grade_run(run, "rule", progress=False)
    assert summary["coverage_complete"] is True and summary["pass_at_1"] == 1.0 and summary["errors"] == 0
    # Samples beyond K (a run later reduced to K=2) are ignored, not counted.
    manifest = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**manifest, "samples": 2}))
    summary = grade_run(run, "rule", progress=False)
    assert summary["expected_samples"] == 4 and summary["graded_samples"] == 4 and summary["coverage_complete"]


def test_grading_needs_a_run_directory_and_the_right_judge(tmp_path):
    with pytest.raises(EvalError, match="run.json is missing"):
        grade_run(tmp_path, "rule")
    run = write_run(tmp_path / "hle", "hle", ["q1"], 1, [generation("q1", 0, "W", "W")])
    with pytest.raises(EvalError, match="hle has no rule judge"):
        grade_run(run, "rule")
    with pytest.raises(EvalError, match="--judge-base-url"):
        grade_run(run, "llm", None)


class RecordingJudge:
    """Answers "yes" when the response ends with the reference; remembers what it was asked."""

    def __init__(self, model: str, fail_on: set[str] = frozenset()):
        self.model, self.fail_on, self.asked = model, fail_on, []

    def judge(self, record: dict) -> Verdict:
        self.asked.append((record["id"], record["sample"]))
        if record["id"] in self.fail_on:
            return Verdict(False, judge_error="unparseable verdict (expected 'yes' or 'no'): 'hmm'", judge_raw="hmm")
        correct = record["response"].endswith(record["reference"])
        return Verdict(correct, judge_raw="yes" if correct else "no")


def test_llm_grading_reuses_saved_verdicts_and_retries_judge_errors(tmp_path):
    records = [generation("q1", s, f"Exact Answer: {a}", "W") for s, a in enumerate(["W", "X"])]
    records += [generation("q2", 0, "Exact Answer: 1989", "1989"), generation("q2", 1, None, "1989", error="boom")]
    run = write_run(tmp_path / "run", "hle", ["q1", "q2"], 2, records)

    flaky = RecordingJudge("judge-a", fail_on={"q2"})
    summary = grade_run(run, "llm", flaky, concurrency=2, progress=False)
    assert sorted(flaky.asked) == [("q1", 0), ("q1", 1), ("q2", 0)]  # a failed generation is not judged
    assert (summary["judge_errors"], summary["generation_errors"], summary["coverage_complete"]) == (1, 1, False)
    assert summary["judge_model"] == "judge-a" and summary["pass_at_1"] == pytest.approx(0.25)

    again = RecordingJudge("judge-a")
    summary = grade_run(run, "llm", again, progress=False)
    assert again.asked == [("q2", 0)]  # only the judge error is asked again
    assert summary["judge_errors"] == 0 and summary["pass_at_1"] == pytest.approx(0.5)

    records[1] = generation("q1", 1, "Exact Answer: W", "W")  # a regenerated response is judged afresh
    write_run(run, "hle", ["q1", "q2"], 2, records)
    changed = RecordingJudge("judge-a")
    assert grade_run(run, "llm", changed, progress=False)["pass_at_1"] == pytest.approx(0.75)
    assert changed.asked == [("q1", 1)]

    other = RecordingJudge("judge-b")  # another judge model re-judges everything
    grade_run(run, "llm", other, progress=False)
    assert sorted(other.asked) == [("q1", 0), ("q1", 1), ("q2", 0)]
    grades = [json.loads(line) for line in (run / "grades-llm.jsonl").read_text().splitlines()]
    assert len(grades) == 4 and {g["judge_model"] for g in grades} == {"judge-b"}
