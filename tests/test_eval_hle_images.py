"""HLE image questions end to end: the dataset's image field (a data URL or a file beside the dataset) is sent
as an image part to our real server (tiny V4.1 vision checkpoint) and through the offline engine, saved as a
hash, judged, and counted in the summary's coverage."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image
from server_harness import running_server

from dsinfer.cli import main
from dsinfer.config import EngineConfig
from dsinfer.images.plan import plan_image
from dsinfer.models.tiny import TINY_VISION


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (90, 160, 30)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def server(tiny_v41_vision_checkpoint):
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512)
    with running_server(tiny_v41_vision_checkpoint, config) as (base, _engine):
        yield base


@pytest.fixture
def dataset(tmp_path):
    (tmp_path / "figure.png").write_bytes(png(60, 40))
    inline = "data:image/png;base64," + base64.b64encode(png(50, 50)).decode()
    rows = [
        {"id": "text", "question": "Name the smallest prime above 100.", "answer": "101", "image": ""},
        {"id": "file", "question": "What color is the figure?", "answer": "green", "image": "figure.png"},
        {"id": "no-file", "question": "What color is the figure?", "answer": "green"},
        {"id": "inline", "question": "What shape is the image?", "answer": "square", "image": inline},
    ]
    path = tmp_path / "hle.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_args(data, out, *source):
    return ["eval", "run", "hle", "--data", str(data), *source, "--samples", "1", "--temperature", "0",
            "--reasoning-effort", "none", "--max-tokens", "4", "--out", str(out), "--no-progress"]  # fmt: skip


def generations(out) -> dict[str, dict]:
    return {r["id"]: r for r in map(json.loads, (out / "generations.jsonl").read_text().splitlines())}


def test_image_questions_are_sent_saved_graded_and_counted(server, dataset, tmp_path):
    out = tmp_path / "run"
    assert main(run_args(dataset, out, "--base-url", server)) == 0
    records = generations(out)
    assert all(record["error"] is None for record in records.values())
    image_part = records["file"]["prompt"][1]["content"][1]
    assert image_part["type"] == "image_url" and image_part["image_url"]["url"].startswith("sha256:")
    assert records["file"]["has_image"] and "has_image" not in records["text"]
    # The image span is in the prompt: the same question without its image costs the span fewer tokens.
    span = plan_image(60, 40, TINY_VISION).num_tokens
    assert records["file"]["usage"]["prompt_tokens"] >= records["no-file"]["usage"]["prompt_tokens"] + span
    run = json.loads((out / "run.json").read_text())
    assert run["image_question_ids"] == ["file", "inline"]
    grade = ["eval", "grade", str(out), "--judge-base-url", server, "--judge-max-tokens", "2", "--no-progress"]
    assert main(grade) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["questions"] == 4 and summary["image_questions"] == 2
    assert summary["image_questions_covered"] == 2 - sum(
        row["errors"] > 0 for row in summary["per_question"] if row["id"] in ("file", "inline")
    )


def test_offline_engine_answers_image_questions_like_the_server(server, dataset, tiny_v41_vision_checkpoint, tmp_path):
    online, offline = tmp_path / "online", tmp_path / "offline"
    assert main(run_args(dataset, online, "--base-url", server)) == 0
    assert main(run_args(dataset, offline, "--model-dir", str(tiny_v41_vision_checkpoint), "--device", "cpu")) == 0
    a, b = generations(online), generations(offline)
    for qid in ("file", "inline"):
        assert a[qid]["usage"]["prompt_tokens"] == b[qid]["usage"]["prompt_tokens"]
        assert a[qid]["response"] == b[qid]["response"]
