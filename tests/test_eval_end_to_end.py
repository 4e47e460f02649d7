"""``dsinfer eval run`` / ``grade`` end to end against our real server on loopback (tiny random model).

The tiny model answers garbage, so these tests check structure and bookkeeping: files, counts, summary
fields, coverage, pass@1 recomputed from the grades, seeded reproducibility, resumption after a crash, and
the LLM judge's handling of unparseable verdicts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from server_harness import running_server

from dsinfer.cli import main
from dsinfer.config import EngineConfig
from dsinfer.eval.backends import GenerationOptions, OpenAIBackend
from dsinfer.eval.datasets import load_dataset, sample_seed
from dsinfer.eval.generate import GenerationRun, run_generation
from dsinfer.eval.records import read_records

SAMPLES = Path(__file__).resolve().parents[1] / "eval" / "samples"
K = 2
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512)
    with running_server(tiny_checkpoint, config) as (base, _engine):
        yield base


def run_args(benchmark: str, base: str, out: Path, *, effort: str = "low", concurrency: int = 4) -> list[str]:
    return ["eval", "run", benchmark, "--data", str(SAMPLES / f"{benchmark}.jsonl"), "--base-url", base,
            "--samples", str(K), "--temperature", "0.8", "--reasoning-effort", effort,
            "--max-tokens", str(MAX_TOKENS), "--concurrency", str(concurrency), "--out", str(out),
            "--no-progress"]  # fmt: skip


def lines(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def content(records: list[dict]) -> dict:
    """Records by (id, sample) without what legitimately differs between runs (timing)."""
    return {(r["id"], r["sample"]): {k: v for k, v in r.items() if k != "timing"} for r in records}


def check_summary_against_grades(summary: dict, grades: list[dict], generations: list[dict]) -> None:
    by_question: dict[str, list[bool]] = {}
    for grade in grades:
        by_question.setdefault(grade["id"], []).append(grade["correct"])
    expected_pass = sum(sum(v) / K for v in by_question.values()) / len(by_question)
    assert summary["pass_at_1"] == pytest.approx(expected_pass)
    assert summary["correct_samples"] == sum(g["correct"] for g in grades)
    assert summary["truncated"] == sum(g["finish_reason"] == "length" for g in generations)
    assert [q["id"] for q in summary["per_question"]] == list(by_question)
    for row in summary["per_question"]:
        assert row["samples"] == K and row["correct"] == sum(by_question[row["id"]])


@pytest.fixture(scope="module")
def aime_run(server, tmp_path_factory):
    """An uninterrupted AIME run (K=2): the reference the resumed run must equal."""
    out = tmp_path_factory.mktemp("aime") / "run"
    assert main(run_args("aime", server, out)) == 0
    return out


def test_aime_generation_and_rule_grading(server, aime_run, capsys):
    generations = lines(aime_run / "generations.jsonl")
    questions = load_dataset("aime", SAMPLES / "aime.jsonl")
    assert {(r["id"], r["sample"]) for r in generations} == {(q.id, s) for q in questions for s in range(K)}
    answers = {q.id: q.answer for q in questions}
    problems = {q.id: q.text for q in questions}
    for record in generations:
        assert record["error"] is None and record["finish_reason"] in ("stop", "length")
        assert record["reference"] == answers[record["id"]]
        assert record["seed"] == sample_seed(0, record["id"], record["sample"])
        assert problems[record["id"]] in record["prompt"][0]["content"]
        assert "\\boxed{}" in record["prompt"][0]["content"]
        assert 1 <= record["usage"]["completion_tokens"] <= MAX_TOKENS
        assert isinstance(record["response"], str) and record["timing"]["latency_s"] >= 0
    manifest = json.loads((aime_run / "run.json").read_text())
    assert manifest["samples"] == K and manifest["question_ids"] == [q.id for q in questions]

    capsys.readouterr()
    assert main(["eval", "grade", str(aime_run), "--no-progress"]) == 0  # default judge for AIME: rule
    grades = lines(aime_run / "grades-rule.jsonl")
    summary = json.loads((aime_run / "summary.json").read_text())
    assert json.loads(capsys.readouterr().out)["pass_at_1"] == summary["pass_at_1"]
    assert len(grades) == len(generations) == 6
    assert summary["judge"] == "rule" and summary["benchmark"] == "aime" and summary["model"] == "tiny"
    assert (summary["questions"], summary["samples_per_question"], summary["expected_samples"]) == (3, K, 6)
    assert summary["graded_samples"] == 6 and summary["errors"] == 0 and summary["missing"] == 0
    assert summary["coverage_complete"] is True
    check_summary_against_grades(summary, grades, generations)

    before = (aime_run / "generations.jsonl").read_bytes()
    assert main(run_args("aime", server, aime_run)) == 0  # nothing left to do
    assert "6 already done, 0 generated" in capsys.readouterr().out
    assert (aime_run / "generations.jsonl").read_bytes() == before


def test_resume_after_a_crash_equals_an_uninterrupted_run(server, aime_run, tmp_path):
    out = tmp_path / "resumed"
    options = GenerationOptions(temperature=0.8, top_p=1.0, max_tokens=MAX_TOKENS, reasoning_effort="low")
    run = GenerationRun("aime", SAMPLES / "aime.jsonl", K, options, seed=0, concurrency=2)
    written = []

    def crash_after_three(record: dict) -> None:
        written.append(record)
        if len(written) == 3:
            raise KeyboardInterrupt  # the process dies here: 3 records are on disk, the rest are lost

    backend = OpenAIBackend(server, None, None, timeout=60, max_retries=0)
    with pytest.raises(KeyboardInterrupt):
        run_generation(run, backend, out, progress=False, on_record=crash_after_three)
    path = out / "generations.jsonl"
    assert len(lines(path)) == 3

    # A failed sample and a torn last line, as a flaky server and a crash mid-write would leave them.
    done = {(r["id"], r["sample"]) for r in written}
    missing = sorted({("aime-s1", 0), ("aime-s2", 0), ("aime-s3", 0), ("aime-s1", 1), ("aime-s2", 1),
                      ("aime-s3", 1)} - done)  # fmt: skip
    failed = {**written[0], "id": missing[0][0], "sample": missing[0][1], "response": None,
              "error": "APIConnectionError: Connection error."}  # fmt: skip
    with path.open("a") as handle:
        handle.write(json.dumps(failed) + "\n")
        handle.write(json.dumps(written[1])[:40])  # torn: no newline, cut mid-record
    records, torn = read_records(path)
    assert len(records) == 4 and torn

    assert main(run_args("aime", server, out, concurrency=3)) == 0
    resumed = lines(path)
    assert len(resumed) == 6  # no duplicates: the failed record was replaced, the torn line dropped
    assert content(resumed) == content(lines(aime_run / "generations.jsonl"))


def test_gpqa_options_are_shuffled_per_sample_and_graded_by_letter(server, tmp_path):
    out = tmp_path / "gpqa"
    assert main(run_args("gpqa", server, out, effort="none")) == 0
    generations = lines(out / "generations.jsonl")
    questions = {q.id: q for q in load_dataset("gpqa", SAMPLES / "gpqa.jsonl")}
    orders = set()
    for record in generations:
        question = questions[record["id"]]
        assert sorted(record["options"]) == sorted([question.answer, *question.incorrect])
        assert record["reference"] == record["correct_letter"] in "ABCD"
        assert record["options"]["ABCD".index(record["correct_letter"])] == question.answer
        listing = "\n".join(f"{letter}) {option}" for letter, option in zip("ABCD", record["options"], strict=True))
        assert listing in record["prompt"][0]["content"]
        assert record["reasoning"] is None  # thinking off
        orders.add(tuple(record["options"]))
    assert len(orders) > 3  # the order changes between samples, not only between questions

    assert main(["eval", "grade", str(out), "--judge", "rule", "--no-progress"]) == 0
    grades = lines(out / "grades-rule.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    assert all(g["reference"] in "ABCD" and (g["extracted"] is None or g["extracted"] in "ABCD") for g in grades)
    assert summary["coverage_complete"] is True and summary["benchmark"] == "gpqa"
    check_summary_against_grades(summary, grades, generations)


def test_hle_llm_judge_against_our_server_counts_garbage_verdicts_as_judge_errors(server, tmp_path, capsys):
    out = tmp_path / "hle"
    assert main(run_args("hle", server, out, effort="none")) == 0
    generations = lines(out / "generations.jsonl")
    assert generations[0]["prompt"][0]["role"] == "system" and "Exact Answer" in generations[0]["prompt"][0]["content"]

    capsys.readouterr()
    assert main(["eval", "grade", str(out), "--judge", "rule"]) == 2
    assert "hle has no rule judge" in capsys.readouterr().err
    assert main(["eval", "grade", str(out)]) == 2  # default judge for HLE: llm, which needs an endpoint
    assert "--judge-base-url" in capsys.readouterr().err

    args = ["eval", "grade", str(out), "--judge-base-url", server, "--judge-max-tokens", "4", "--no-progress"]
    assert main(args) == 0
    grades = lines(out / "grades-llm.jsonl")
    summary = json.loads((out / "summary.json").read_text())
    assert len(grades) == 6 and all(g["judge_model"] == "tiny" for g in grades)
    asked = [g for g in grades if g["judge_raw"] is not None or g["judge_error"]]
    answered = {(r["id"], r["sample"]) for r in generations if r["response"].strip()}
    assert {(g["id"], g["sample"]) for g in asked} == answered  # the judge is asked exactly when there is an answer
    for grade in grades:
        verdict = (grade["judge_raw"] or "").strip().strip(".").lower()
        if grade["judge_error"]:
            assert grade["judge_error"].startswith("unparseable verdict") and grade["correct"] is False
        elif grade["judge_raw"] is not None:
            assert verdict in ("yes", "no") and grade["correct"] == (verdict == "yes")
    judge_errors = sum(bool(g["judge_error"]) for g in grades)
    assert summary["judge_errors"] == summary["errors"] == judge_errors
    assert summary["coverage_complete"] is (judge_errors == 0)
    assert summary["judge"] == "llm" and summary["judge_model"] == "tiny"
    check_summary_against_grades(summary, grades, generations)


def test_offline_engine_matches_the_server(server, tiny_checkpoint, tmp_path):
    """--model-dir renders and parses exactly as the server does: same seeded samples, same records."""
    served, offline = tmp_path / "served", tmp_path / "offline"
    assert main(run_args("gpqa", server, served, effort="low")) == 0
    args = run_args("gpqa", server, offline, effort="low")
    at = args.index("--base-url")
    args[at : at + 2] = ["--model-dir", str(tiny_checkpoint), "--device", "cpu"]
    assert main(args) == 0
    expected, got = content(lines(served / "generations.jsonl")), content(lines(offline / "generations.jsonl"))
    for record in (*expected.values(), *got.values()):
        record.pop("model")
    assert got == expected
    assert json.loads((offline / "run.json").read_text())["backend"] == "offline"


def test_a_rerun_with_other_settings_is_refused(server, aime_run, capsys):
    args = run_args("aime", server, aime_run)
    args[args.index("--temperature") + 1] = "0.5"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "temperature=0.8" in err and "temperature=0.5" in err and "another --out" in err
    assert main([*run_args("aime", server, aime_run), "--limit", "1"]) == 2
    assert "covers other questions" in capsys.readouterr().err


def test_run_script_generates_then_grades(server, aime_run, tmp_path):
    """eval/aime/run.sh passes its settings through (a copy of the reference run resumes with nothing to do,
    which only happens when every setting matches) and grades with the rule judge."""
    out = tmp_path / "scripted"
    shutil.copytree(aime_run, out)
    (out / "summary.json").unlink(missing_ok=True)
    # `dsinfer` on PATH runs the eval CLI directly: the script is under test, not the torch-importing dispatcher.
    shim = tmp_path / "bin" / "dsinfer"
    shim.parent.mkdir()
    shim.write_text(f"#!{sys.executable}\nimport sys\nfrom dsinfer.eval.cli import main\n"
                    "assert sys.argv[1] == 'eval'\nsys.exit(main(sys.argv[2:]))\n")  # fmt: skip
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shim.parent}:{os.environ['PATH']}", "BASE_URL": server, "OUT": str(out),
           "K": str(K), "TEMPERATURE": "0.8", "MAX_TOKENS": str(MAX_TOKENS), "REASONING_EFFORT": "low"}  # fmt: skip
    script = SAMPLES.parent / "aime" / "run.sh"
    done = subprocess.run(["bash", str(script), str(SAMPLES / "aime.jsonl")], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "6 already done, 0 generated" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["judge"] == "rule" and summary["coverage_complete"] is True and summary["expected_samples"] == 6
