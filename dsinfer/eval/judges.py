"""Judges: deterministic rule judges for AIME (an integer) and GPQA (an option letter), and an LLM judge.

Rule judges read only the final answer text (``response``; reasoning is never searched, and an inline
``<think>...</think>`` block is removed first), so a number that appears while thinking is not mistaken for
the answer. Extraction order, the first that applies wins:

* AIME: the last ``\\boxed{...}`` (or ``\\fbox``), else the last "answer is N" / "Answer: N" / "final answer:
  N" phrase. The text is cleaned of LaTeX wrappers (``\\text{}``, ``$``, ``\\,``), a leading ``x =``, a trailing
  period and thousands separators, then must be an integer (``042`` and ``42.0`` are 42) in 0-999.
  Fractions, decimals, negatives, several numbers or anything else extract nothing (graded incorrect).
* GPQA: the last ``\\boxed{...}`` holding one option letter; else the last answer phrase ("the answer is C",
  "Answer: (C)", "correct option is **C**"); else the last unambiguous mention: "(C)", "option C",
  "choice C", or a line that is only the letter. Letters are upper-case A-D; a bare "A" followed by a
  lower-case word ("the answer is A bit ...") is read as the article, not an option.

The LLM judge asks any OpenAI-compatible model a yes/no question with the reference answer and parses the
verdict strictly: after trimming whitespace, markdown and final punctuation the reply must be exactly "yes" or
"no". Anything else (garbage, hedging, an empty reply, a failed request) is a *judge error*: the sample counts
as incorrect in pass@1, is counted under ``judge_errors``, and makes ``coverage_complete`` false; a rerun of
``grade`` retries only those samples.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

from dsinfer.eval.datasets import EvalError, message_text

# ---- shared text helpers -----------------------------------------------------------------------
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)
_LATEX_WRAPPER = re.compile(
    r"\\(?:text|textbf|textit|textnormal|mathrm|mathbf|mathit|operatorname|mbox)\s*\{([^{}]*)\}"
)
_LATEX_SPACING = re.compile(r"\\[,;:! ]|\\quad|\\qquad|~|\\displaystyle|\\left|\\right")


def final_answer_text(response: str | None) -> str:
    """The answer part of a response: inline reasoning (``<think>...</think>``, or text before a lone
    ``</think>``) removed."""
    text = response or ""
    text = _THINK_BLOCK.sub("", text)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    return text


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces balanced), or None."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*", text)]
    for start in reversed(starts):
        if start < len(text) and text[start] == "{":
            depth = 0
            for position in range(start, len(text)):
                if text[position] == "{":
                    depth += 1
                elif text[position] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[start + 1 : position]
            continue  # unclosed: look at an earlier one
        match = re.match(r"([^\s$]+)", text[start:])  # "\boxed 42"
        if match:
            return match.group(1)
    return None


def _unwrap_latex(text: str) -> str:
    previous = None
    while previous != text:
        previous, text = text, _LATEX_WRAPPER.sub(r"\1", text)
    text = _LATEX_SPACING.sub("", text.replace("{,}", ","))
    for token in ("$", "\\(", "\\)", "\\[", "\\]", "**", "__"):
        text = text.replace(token, "")
    return text.strip()


# ---- AIME --------------------------------------------------------------------------------------
_INTEGER = re.compile(r"^\+?(\d+)(?:\.0*)?$")
_THOUSANDS = re.compile(r"^[1-9]\d{0,2}(?:,\d{3})+(?:\.0*)?$")
_DEGREES = re.compile(r"\^\s*\{?\\circ\}?$")
_AIME_PHRASE = re.compile(
    r"\b(?:final\s+answer|answer)\b(?:\s+(?:is|would\s+be|should\s+be))?[\s:=*$]*(?:\\boxed\{|\\\(|\\\[)?\s*"
    r"([+-]?\d(?:[\d,]*\d)?(?:\.\d+)?)(?![\d/^_\\]|\.\d|,\d)",
    re.IGNORECASE,
)


def parse_aime_integer(raw: str) -> int | None:
    """An AIME answer from a boxed / phrase fragment: an integer 0-999, else None."""
    text = _unwrap_latex(raw)
    if "=" in text:
        text = text.rsplit("=", 1)[1].strip()
    text = _DEGREES.sub("", text).rstrip(".").strip()
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    match = _INTEGER.match(text)
    if not match:
        return None
    value = int(match.group(1))
    return value if 0 <= value <= 999 else None


def extract_aime_answer(response: str | None) -> int | None:
    """The integer a response gives as its final answer (see the module docstring for the rules)."""
    text = final_answer_text(response)
    boxed = last_boxed(text)
    if boxed is not None:
        return parse_aime_integer(boxed)
    phrases = list(_AIME_PHRASE.finditer(text))
    return parse_aime_integer(phrases[-1].group(1)) if phrases else None


# ---- GPQA --------------------------------------------------------------------------------------
# "C", "(C)", "C.", "C: text", "(C) text"; text after the letter needs a delimiter ("A or B" is not a choice).
_LETTER_IN_FRAGMENT = re.compile(
    r"^[(\[]?\s*(?P<letter>[A-Da-d])\s*(?P<delimiter>[)\]][.:]?|[.:\-–—])?\s*(?P<rest>.*)$", re.S
)
_GPQA_PHRASE = re.compile(
    r"(?i:\b(?:final\s+answer|correct\s+answer|correct\s+option|correct\s+choice|best\s+answer|answer))"
    r"(?:\s+(?i:is|would\s+be|should\s+be|must\s+be))?\s*(?i:option|choice)?\s*[:=]?\s*(?:\*\*|__)?\s*"
    r"(?:\\text\{)?\s*(?P<open>[(\[])?(?P<letter>[A-D])(?P<close>[)\]])?(?![A-Za-z0-9])"
)
_GPQA_MENTION = re.compile(
    r"[(\[](?P<paren>[A-D])[)\]]"
    r"|\b(?i:option|choice)\s+(?P<named>[A-D])(?![A-Za-z0-9])"
    r"|^[ \t>*_#]*(?P<line>[A-D])[ \t*_]*[.)]?[ \t*_]*$",
    re.MULTILINE,
)


def _letter_from_boxed(fragment: str) -> str | None:
    match = _LETTER_IN_FRAGMENT.match(_unwrap_latex(fragment))
    if not match or (match.group("rest") and not match.group("delimiter")):
        return None
    return match.group("letter").upper()


def _article_not_option(text: str, match: re.Match, letter_group: str) -> bool:
    """A bare ``A`` followed by a lower-case word is the article ("the answer is A bit ...")."""
    if match.group(letter_group) != "A" or match.groupdict().get("open"):
        return False
    return re.match(r"\s+[a-z]", text[match.end(letter_group) :]) is not None


def extract_gpqa_letter(response: str | None) -> str | None:
    """The option letter a response chooses (see the module docstring for the rules)."""
    text = final_answer_text(response)
    boxed = last_boxed(text)
    if boxed is not None:
        return _letter_from_boxed(boxed)
    phrases = [m for m in _GPQA_PHRASE.finditer(text) if not _article_not_option(text, m, "letter")]
    if phrases:
        return phrases[-1].group("letter")
    mentions = list(_GPQA_MENTION.finditer(text))
    if mentions:
        last = mentions[-1]
        return last.group("paren") or last.group("named") or last.group("line")
    return None


# ---- verdicts ----------------------------------------------------------------------------------
@dataclass
class Verdict:
    correct: bool
    extracted: str | None = None  # what the rule judge read as the answer
    judge_error: str | None = None
    judge_raw: str | None = None  # the LLM judge's reply


def rule_judge(benchmark: str, response: str | None, reference: str) -> Verdict:
    """Grade one response with the benchmark's rule judge."""
    if benchmark == "aime":
        answer = extract_aime_answer(response)
        return Verdict(answer is not None and answer == int(reference), None if answer is None else str(answer))
    if benchmark == "gpqa":
        letter = extract_gpqa_letter(response)
        return Verdict(letter is not None and letter == reference, letter)
    require_rule_judge(benchmark)
    raise AssertionError(f"no rule judge for {benchmark}")


def require_rule_judge(benchmark: str) -> None:
    """HLE (and anything else free-form) has no rule judge: say so instead of grading everything wrong."""
    if benchmark not in ("aime", "gpqa"):
        raise EvalError(f"{benchmark} has no rule judge: its answers are free-form and need an LLM judge; "
                        "use --judge llm")  # fmt: skip


def parse_verdict(reply: str | None) -> bool | None:
    """``True`` for "yes", ``False`` for "no" (case, whitespace, markdown, quotes, final punctuation ignored);
    ``None`` for anything else."""
    text = final_answer_text(reply).strip()
    text = re.sub(r"^[\s*_`\"'“”‘’]+|[\s*_`\"'“”‘’.!]+$", "", text).lower()
    return {"yes": True, "no": False}.get(text)


JUDGE_PROMPT = """Judge whether the [response] to the [question] is correct, based on the precise and unambiguous \
[correct_answer] below.

[question]: {question}

[response]: {response}

[correct_answer]: {reference}

Find the final answer the response gives. It is correct only if it is equivalent to the correct answer \
(for numbers, small rounding differences are fine; for multiple choice, the same option). A response that gives \
no final answer, several different answers, or an answer that differs in any meaningful way is incorrect.

Reply with exactly one word: yes if the final answer is correct, no otherwise."""
#: The judge sees at most this many characters of a response: its end, where the final answer is.
JUDGE_RESPONSE_CHARS = 20000


def judge_question(record: dict[str, Any]) -> str:
    """The question as the model saw it: the last user message (GPQA: with its options in this sample's order)."""
    users = [message_text(m["content"]) for m in record.get("prompt", []) if m.get("role") == "user"]
    return users[-1] if users else ""


def judge_reference(record: dict[str, Any]) -> str:
    """The reference answer as the judge should read it (GPQA: the letter and the option's text)."""
    if record.get("benchmark") == "gpqa" and "options" in record:
        letter = record["reference"]
        return f"{letter}) {record['options']['ABCD'.index(letter)]}"
    return str(record["reference"])


def fingerprint(record: dict[str, Any]) -> str:
    """Identifies what was judged, so a saved LLM verdict is reused only for the very same response."""
    text = "\x00".join([str(record.get("response")), str(record.get("reference")), judge_question(record)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class LLMJudge:
    """A yes/no correctness judge on any OpenAI-compatible endpoint (temperature 0, standard fields only)."""

    def __init__(self, base_url: str, model: str | None, api_key: str | None, timeout: float, max_retries: int,
                 max_tokens: int) -> None:  # fmt: skip
        from dsinfer.eval.backends import normalize_base_url, openai_client, resolve_model

        self.base_url = normalize_base_url(base_url)
        self.client = openai_client(base_url, api_key, timeout, max_retries)
        self.model = resolve_model(self.client, model, self.base_url)
        self.max_tokens = max_tokens

    def judge(self, record: dict[str, Any]) -> Verdict:
        import openai

        answer = final_answer_text(record.get("response")).strip()
        if not answer:
            return Verdict(False, judge_raw=None)  # nothing to judge: no final answer (e.g. cut off while thinking)
        prompt = JUDGE_PROMPT.format(
            question=judge_question(record), response=answer[-JUDGE_RESPONSE_CHARS:], reference=judge_reference(record)
        )
        try:
            reply = self.client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=self.max_tokens,
                temperature=0.0,
            )
        except openai.OpenAIError as exc:
            return Verdict(False, judge_error=f"{type(exc).__name__}: {exc}")
        content = reply.choices[0].message.content if reply.choices else None
        verdict = parse_verdict(content)
        if verdict is None:
            shown = (content or "")[:200]
            return Verdict(False, judge_error=f"unparseable verdict (expected 'yes' or 'no'): {shown!r}",
                           judge_raw=content)  # fmt: skip
        return Verdict(verdict, judge_raw=content)
