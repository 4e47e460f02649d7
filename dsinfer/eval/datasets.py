"""Eval datasets (JSONL files the user places; never downloaded) and the prompts built from them.

Each benchmark reads one JSON object per line:

* AIME: ``{"id", "problem", "answer"}`` with an integer answer in 0-999 (an int or a string of digits);
* GPQA: ``{"id", "question", "correct", "incorrect": [three strings]}``;
* HLE: ``{"id", "question", "answer"}`` and, for image questions, ``"image"``: a data URL
  (``data:image/png;base64,...``, as HLE's own files hold it) or a path relative to the dataset file (png, jpeg,
  webp, gif); empty or absent for text questions. Remote URLs are refused: nothing is downloaded.

A bad line is an :class:`EvalError` naming the file, the line number and the field, so a user fixes the file
instead of reading a traceback. Prompts are deterministic functions of (question, sample index, seed): a rerun
asks exactly the same thing, which is what makes resumed runs equal to uninterrupted ones.
"""

from __future__ import annotations

import base64
import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsinfer.config.json_object import json_object

BENCHMARKS = ("aime", "gpqa", "hle")
#: Samples per question used for the published pass@1 numbers (DeepInfer's eval scripts).
DEFAULT_SAMPLES = {"aime": 32, "gpqa": 8, "hle": 1}
#: Bumped whenever a prompt text changes: a run directory records it so old and new prompts never mix.
PROMPT_VERSION = 1
GPQA_LETTERS = "ABCD"

AIME_INSTRUCTION = (
    "Please reason step by step, and put your final answer within \\boxed{}. "
    "The answer is an integer between 0 and 999 inclusive."
)
GPQA_INSTRUCTION = (
    "Answer the following multiple-choice question. Think step by step, then put the letter of the correct "
    "option (A, B, C or D) within \\boxed{}, for example \\boxed{B}."
)
# The system prompt of the official HLE evaluation (text questions).
HLE_SYSTEM_PROMPT = (
    "Your response should be in the following format:\n"
    "Explanation: {your explanation for your final answer}\n"
    "Exact Answer: {your succinct, final answer}\n"
    "Confidence: {your confidence score between 0% and 100% for your answer}"
)


class EvalError(ValueError):
    """Bad eval input (dataset file, run directory, flag combination): the message names what is wrong."""


@dataclass(frozen=True)
class Question:
    """One dataset item. ``answer`` is the reference (GPQA: the correct option's text); ``incorrect`` is GPQA-only."""

    id: str
    text: str
    answer: str
    incorrect: tuple[str, ...] = ()
    image: str | None = None  # HLE: a data URL; None for a text question


@dataclass(frozen=True)
class SampleRequest:
    """Everything needed to generate one (question, sample) and to grade it later without the dataset."""

    question_id: str
    sample: int
    messages: list[dict[str, Any]]  # content: a string, or text and image_url parts (HLE image questions)
    seed: int
    reference: str
    extra: dict[str, Any] = field(default_factory=dict)  # GPQA: correct_letter and the presented options

    @property
    def key(self) -> tuple[str, int]:
        return (self.question_id, self.sample)


# ---- loading -----------------------------------------------------------------------------------
_TEXT_FIELDS = {"aime": ("problem",), "gpqa": ("question", "correct"), "hle": ("question",)}


def load_dataset(benchmark: str, path: str | Path) -> list[Question]:
    """Read and validate a benchmark's JSONL file; every problem names ``path:line`` and the field."""
    if benchmark not in BENCHMARKS:
        raise EvalError(f"unknown benchmark {benchmark!r}: expected one of {', '.join(BENCHMARKS)}")
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        message = f"dataset file {path} does not exist (datasets are never downloaded; see eval/README.md)"
        raise EvalError(message) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalError(f"dataset file {path} cannot be read: {exc}") from None
    questions: list[Question] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        item = json_object(line, where, EvalError)
        question = _parse_item(benchmark, item, where, path.parent)
        if question.id in seen:
            raise EvalError(f"{where}: duplicate id {question.id!r} (first on line {seen[question.id]})")
        seen[question.id] = number
        questions.append(question)
    if not questions:
        raise EvalError(f"dataset file {path} holds no questions")
    return questions


def _parse_item(benchmark: str, item: dict, where: str, base_dir: Path) -> Question:
    qid = _field(item, "id", where)
    if isinstance(qid, bool) or not isinstance(qid, (str, int)) or str(qid).strip() == "":
        raise EvalError(f"{where}: field 'id' must be a non-empty string or an integer, got {qid!r}")
    texts = {name: _text(item, name, where) for name in _TEXT_FIELDS[benchmark]}
    if benchmark == "aime":
        return Question(str(qid), texts["problem"], str(_aime_answer(item, where)))
    if benchmark == "hle":
        answer = _field(item, "answer", where)
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)) or str(answer).strip() == "":
            raise EvalError(f"{where}: field 'answer' must be a non-empty string or a number, got {answer!r}")
        return Question(str(qid), texts["question"], str(answer), image=_image(item.get("image"), where, base_dir))
    incorrect = _field(item, "incorrect", where)
    if not isinstance(incorrect, list) or len(incorrect) != 3:
        raise EvalError(f"{where}: field 'incorrect' must be a list of exactly 3 strings, got {incorrect!r}")
    for index, option in enumerate(incorrect):
        if not isinstance(option, str) or not option.strip():
            raise EvalError(f"{where}: field 'incorrect[{index}]' must be a non-empty string, got {option!r}")
    options = [texts["correct"].strip(), *(o.strip() for o in incorrect)]
    if len(set(options)) != 4:
        raise EvalError(f"{where}: the four options (correct + incorrect) must be distinct")
    return Question(str(qid), texts["question"], texts["correct"], tuple(incorrect))


_IMAGE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
                ".gif": "image/gif"}  # fmt: skip


def _image(value: Any, where: str, base_dir: Path) -> str | None:
    """An HLE ``image`` field as a data URL: kept if it is one, read from a file beside the dataset otherwise."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise EvalError(f"{where}: field 'image' must be a data URL or a file path, got {type(value).__name__}")
    if value.startswith("data:"):
        if not value.startswith("data:image/") or "," not in value:
            raise EvalError(f"{where}: field 'image' is not an image data URL (data:image/...;base64,...)")
        return value
    if value.startswith(("http://", "https://")):
        raise EvalError(f"{where}: field 'image' is a remote URL; images are never downloaded: embed it as a data "
                        f"URL or give a file path relative to the dataset")  # fmt: skip
    file = base_dir / value
    kind = _IMAGE_TYPES.get(file.suffix.lower())
    if kind is None:
        raise EvalError(f"{where}: field 'image' {value!r}: expected a .png, .jpg, .jpeg, .webp or .gif file")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise EvalError(f"{where}: field 'image' {value!r} cannot be read ({exc.strerror or exc})") from None
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def recorded_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The prompt as saved with a generation: image data URLs replaced by their sha256 (they can be megabytes)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [_recorded_part(part) for part in content]
        out.append({**message, "content": content})
    return out


def _recorded_part(part: dict[str, Any]) -> dict[str, Any]:
    if part.get("type") != "image_url":
        return part
    url = part["image_url"]["url"]
    return {"type": "image_url", "image_url": {"url": "sha256:" + hashlib.sha256(url.encode()).hexdigest()}}


def message_text(content: Any) -> str:
    """A message's text: the string, or the text parts joined (an image part reads as ``[image]``)."""
    if isinstance(content, str):
        return content
    return "\n\n".join(p.get("text", "") if p.get("type") == "text" else "[image]" for p in content or [])


def _field(item: dict, name: str, where: str) -> Any:
    if name not in item or item[name] is None:
        raise EvalError(f"{where}: missing field {name!r}")
    return item[name]


def _text(item: dict, name: str, where: str) -> str:
    value = _field(item, name, where)
    if not isinstance(value, str) or not value.strip():
        raise EvalError(f"{where}: field {name!r} must be a non-empty string, got {value!r}")
    return value


def _aime_answer(item: dict, where: str) -> int:
    raw = _field(item, "answer", where)
    text = str(raw).strip() if not isinstance(raw, bool) else ""
    if not text.isdigit() or not 0 <= int(text) <= 999:
        raise EvalError(f"{where}: field 'answer' must be an integer from 0 to 999, got {raw!r}")
    return int(text)


def file_sha256(path: str | Path) -> str:
    """Content hash of the dataset, recorded in run.json so a changed file is never mixed into a run."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# ---- prompts -----------------------------------------------------------------------------------
def sample_seed(seed: int, question_id: str, sample: int) -> int:
    """A per-sample seed (31 bits) from the run seed: independent of order, concurrency and resumption."""
    digest = hashlib.sha256(f"{seed}:{question_id}:{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def gpqa_options(question: Question, seed: int, sample: int) -> tuple[list[str], str]:
    """The four options in this sample's order and the letter of the correct one (a seeded shuffle)."""
    options = [question.answer.strip(), *(o.strip() for o in question.incorrect)]
    order = list(range(4))
    random.Random(sample_seed(seed, question.id, sample)).shuffle(order)
    shuffled = [options[i] for i in order]
    return shuffled, GPQA_LETTERS[order.index(0)]


def build_request(benchmark: str, question: Question, sample: int, seed: int) -> SampleRequest:
    """The chat messages and grading reference of one sample."""
    per_sample_seed = sample_seed(seed, question.id, sample)
    extra: dict[str, Any] = {}
    if benchmark == "aime":
        messages = [{"role": "user", "content": f"{question.text.strip()}\n\n{AIME_INSTRUCTION}"}]
        reference = question.answer
    elif benchmark == "gpqa":
        options, letter = gpqa_options(question, seed, sample)
        listing = "\n".join(f"{GPQA_LETTERS[i]}) {option}" for i, option in enumerate(options))
        messages = [{"role": "user", "content": f"{GPQA_INSTRUCTION}\n\n{question.text.strip()}\n\n{listing}"}]
        reference = letter
        extra = {"correct_letter": letter, "options": options}
    elif benchmark == "hle":
        content: Any = question.text.strip()
        if question.image is not None:
            content = [{"type": "text", "text": content}, {"type": "image_url", "image_url": {"url": question.image}}]
            extra = {"has_image": True}
        messages = [{"role": "system", "content": HLE_SYSTEM_PROMPT}, {"role": "user", "content": content}]
        reference = question.answer
    else:
        raise EvalError(f"unknown benchmark {benchmark!r}: expected one of {', '.join(BENCHMARKS)}")
    return SampleRequest(question.id, sample, messages, per_sample_seed, reference, extra)


def build_requests(benchmark: str, questions: list[Question], samples: int, seed: int) -> list[SampleRequest]:
    """All (question, sample) requests, sample-major so early results cover every question once."""
    return [build_request(benchmark, q, s, seed) for s in range(samples) for q in questions]
