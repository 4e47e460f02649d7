"""Dataset files (validation with file:line messages, deterministic prompts) and the crash-safe record file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsinfer.cli import main
from dsinfer.eval.backends import GenerationOptions
from dsinfer.eval.datasets import (
    BENCHMARKS,
    EvalError,
    build_request,
    build_requests,
    gpqa_options,
    load_dataset,
)
from dsinfer.eval.generate import GenerationRun, lock_run_directory, run_generation
from dsinfer.eval.records import append_record, latest_by_key, open_for_append, read_records

SAMPLES = Path(__file__).resolve().parents[1] / "eval" / "samples"


@pytest.mark.parametrize("benchmark", BENCHMARKS)
def test_sample_files_load(benchmark):
    questions = load_dataset(benchmark, SAMPLES / f"{benchmark}.jsonl")
    assert 3 <= len(questions) <= 5 and len({q.id for q in questions}) == len(questions)


GOOD = {
    "aime": {"id": 1, "problem": "What is 1 + 1?", "answer": 2},
    "gpqa": {"id": "g", "question": "Q?", "correct": "yes", "incorrect": ["no", "maybe", "never"]},
    "hle": {"id": "h", "question": "Q?", "answer": "W"},
}


@pytest.mark.parametrize(
    ("benchmark", "bad_line", "message"),
    [
        ("aime", {"id": 2, "problem": "P"}, "missing field 'answer'"),
        ("aime", {"id": 2, "answer": 3}, "missing field 'problem'"),
        ("aime", {"problem": "P", "answer": 3}, "missing field 'id'"),
        ("aime", {"id": 2, "problem": "P", "answer": 1000}, "field 'answer' must be an integer from 0 to 999"),
        ("aime", {"id": 2, "problem": "P", "answer": "4.5"}, "field 'answer' must be an integer from 0 to 999"),
        ("aime", {"id": 2, "problem": "", "answer": 3}, "field 'problem' must be a non-empty string"),
        ("aime", {"id": 1, "problem": "P", "answer": 3}, "duplicate id '1' (first on line 1)"),
        ("gpqa", {"id": "x", "question": "Q", "correct": "a"}, "missing field 'incorrect'"),
        ("gpqa", {"id": "x", "question": "Q", "correct": "a", "incorrect": ["b", "c"]}, "exactly 3 strings"),
        ("gpqa", {"id": "x", "question": "Q", "correct": "a", "incorrect": ["b", 3, "d"]}, "'incorrect[1]'"),
        ("gpqa", {"id": "x", "question": "Q", "correct": "a", "incorrect": ["a", "c", "d"]}, "must be distinct"),
        ("gpqa", {"id": "x", "question": "Q", "incorrect": ["b", "c", "d"]}, "missing field 'correct'"),
        ("hle", {"id": "y", "question": "Q"}, "missing field 'answer'"),
        ("hle", {"id": "y", "question": "Q", "answer": "A", "image": "data:..."}, "not an image data URL"),
        ("hle", {"id": "y", "question": "Q", "answer": "A", "image": "https://x/a.png"}, "never downloaded"),
        ("hle", {"id": "y", "question": "Q", "answer": "A", "image": "absent.png"}, "cannot be read"),
        ("hle", {"id": "y", "question": "Q", "answer": "A", "image": "a.bmp"}, "expected a .png"),
        ("hle", ["not", "an", "object"], "expected a JSON object"),
    ],
)
def test_malformed_lines_name_file_line_and_field(tmp_path, benchmark, bad_line, message):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD[benchmark]) + "\n\n" + json.dumps(bad_line) + "\n")
    with pytest.raises(EvalError) as error:
        load_dataset(benchmark, path)
    assert f"{path}:3: " in str(error.value) and message in str(error.value)


def test_invalid_json_missing_and_empty_files(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GOOD["hle"]) + "\n{not json\n")
    with pytest.raises(EvalError, match=r"broken\.jsonl:2: not valid JSON"):
        load_dataset("hle", path)
    with pytest.raises(EvalError, match="does not exist.*never downloaded"):
        load_dataset("hle", tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(EvalError, match="holds no questions"):
        load_dataset("hle", tmp_path / "empty.jsonl")


def test_cli_reports_a_malformed_dataset_line(tmp_path, capsys):
    path = tmp_path / "aime.jsonl"
    path.write_text(json.dumps(GOOD["aime"]) + "\n" + json.dumps({"id": 9, "problem": "P"}) + "\n")
    args = ["eval", "run", "aime", "--data", str(path), "--base-url", "http://127.0.0.1:9", "--model", "m",
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "dsinfer eval run: error:" in err and f"{path}:2: missing field 'answer'" in err
    assert not (tmp_path / "out" / "generations.jsonl").exists()


def test_gpqa_shuffle_is_seeded_per_sample_and_records_the_correct_letter():
    question = load_dataset("gpqa", SAMPLES / "gpqa.jsonl")[0]
    orders = {}
    for sample in range(8):
        options, letter = gpqa_options(question, seed=0, sample=sample)
        assert sorted(options) == sorted([question.answer, *question.incorrect])
        assert options["ABCD".index(letter)] == question.answer
        assert gpqa_options(question, seed=0, sample=sample) == (options, letter)  # reproducible
        orders[sample] = tuple(options)
    assert len(set(orders.values())) > 1
    assert [gpqa_options(question, seed=1, sample=s)[0] for s in range(8)] != [list(o) for o in orders.values()]
    request = build_request("gpqa", question, 3, seed=0)
    assert request.reference == request.extra["correct_letter"] == gpqa_options(question, 0, 3)[1]
    assert "\\boxed{" in request.messages[0]["content"] and "D) " in request.messages[0]["content"]


def test_requests_are_sample_major_with_distinct_seeds():
    questions = load_dataset("aime", SAMPLES / "aime.jsonl")
    requests = build_requests("aime", questions, samples=2, seed=0)
    assert [r.key for r in requests[:3]] == [(q.id, 0) for q in questions]
    assert len({r.seed for r in requests}) == len(requests)


def test_a_torn_last_line_is_ignored_and_rewritten_before_appending(tmp_path):
    path = tmp_path / "records.jsonl"
    first, second = {"id": "a", "sample": 0, "v": 1}, {"id": "a", "sample": 1, "v": 2}
    path.write_text(json.dumps(first) + "\n" + json.dumps(second))  # the second line has no newline: torn
    records, torn = read_records(path)
    assert records == [first] and torn
    handle = open_for_append(path, records, rewrite=torn)
    append_record(handle, second)
    handle.close()
    assert path.read_text() == json.dumps(first) + "\n" + json.dumps(second) + "\n"
    assert read_records(path) == ([first, second], False)


def test_a_broken_line_before_the_end_is_reported_not_dropped(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"id": "a", "sample": 0}\n{"id": "a", "samp\n{"id": "b", "sample": 0}\n')
    with pytest.raises(EvalError, match=r"records\.jsonl:2: not a valid record"):
        read_records(path)


def test_latest_by_key_prefers_a_finished_record():
    failed = {"id": "a", "sample": 0, "error": "boom"}
    done = {"id": "a", "sample": 0, "error": None, "response": "x"}
    later = {"id": "a", "sample": 0, "error": None, "response": "y"}
    finished = lambda r: not r.get("error")  # noqa: E731
    assert latest_by_key([failed, done, later], finished) == {("a", 0): done}
    assert latest_by_key([failed], finished) == {("a", 0): failed}


def test_one_writer_per_run_directory(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    options = GenerationOptions(temperature=0.0, top_p=1.0, max_tokens=4, reasoning_effort="none")
    run = GenerationRun("aime", SAMPLES / "aime.jsonl", 1, options)
    with lock_run_directory(out), pytest.raises(EvalError, match="another 'dsinfer eval run' is writing"):
        run_generation(run, backend=None, out_dir=out, progress=False)


def test_an_unreachable_server_is_one_clear_error(tmp_path, capsys):
    args = ["eval", "run", "hle", "--data", str(SAMPLES / "hle.jsonl"), "--base-url", "http://127.0.0.1:9",
            "--max-retries", "0", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(args) == 2
    assert "cannot reach http://127.0.0.1:9/v1" in capsys.readouterr().err
