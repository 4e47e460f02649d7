"""Rule judges (AIME integer, GPQA letter) and the LLM judge's strict verdict parser, on known answers."""

from __future__ import annotations

import pytest

from dsinfer.eval.datasets import EvalError
from dsinfer.eval.judges import extract_aime_answer, extract_gpqa_letter, parse_verdict, rule_judge


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (r"So the total is $\boxed{42}$.", 42),
        (r"\boxed{042}", 42),
        (r"\boxed{42.}", 42),
        (r"\boxed{42.0}", 42),
        (r"\boxed{\text{42}}", 42),
        (r"\boxed{\textbf{ 42 }}", 42),
        (r"\boxed{x = 17}", 17),
        (r"\boxed 42", 42),
        (r"\fbox{7}", 7),
        (r"\boxed{0}", 0),
        (r"\boxed{999}", 999),
        (r"\boxed{42^\circ}", 42),
        (r"first \boxed{12}, on reflection \boxed{13}", 13),
        ("The answer is 42", 42),
        ("The answer is 42.", 42),
        ("Thus the answer is **42**, as claimed.", 42),
        ("Final Answer: 17", 17),
        ("Answer: 007", 7),
        (r"**Final answer:** $\boxed{ 7 }$", 7),
        ("<think>maybe \\boxed{5}</think>The answer is 6", 6),
        ("I reconsidered.</think>\n\\boxed{8}", 8),
    ],
)
def test_aime_extracts_the_final_integer(response, expected):
    assert extract_aime_answer(response) == expected


@pytest.mark.parametrize(
    "response",
    [
        r"\boxed{1000}",  # out of range
        r"$\boxed{1,000}$",  # thousands separator understood, still out of range
        r"\boxed{-5}",
        r"\boxed{42.5}",
        r"\boxed{3/4}",
        r"\boxed{\frac{1}{2}}",
        r"\boxed{\dfrac{84}{2}}",
        r"\boxed{12, 13}",
        r"\boxed{4 2}",
        r"\boxed{}",
        r"\boxed{seven}",
        r"\boxed{x} and the answer is 42",  # a boxed answer is final: no fallback to phrases
        "the answer is 42.5",
        "answer is 3/4",
        "the answer to part 1 is 12",
        "I computed 42 along the way",  # a number is not an answer
        "",
        None,
        "<think>\\boxed{5}</think>",  # only the reasoning has an answer
    ],
)
def test_aime_rejects_non_integers_out_of_range_and_missing_answers(response):
    assert extract_aime_answer(response) is None


def test_aime_thousands_separators_inside_range_are_read():
    assert extract_aime_answer("the answer is 42, since 6 * 7 = 42") == 42
    assert extract_aime_answer(r"\boxed{0{,}042}") is None  # not a thousands group: 0,042 is not an integer


def test_aime_rule_judge_compares_with_the_reference():
    assert rule_judge("aime", r"\boxed{024}", "24").correct
    verdict = rule_judge("aime", r"\boxed{25}", "24")
    assert not verdict.correct and verdict.extracted == "25"
    verdict = rule_judge("aime", "no idea", "24")
    assert not verdict.correct and verdict.extracted is None


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        (r"\boxed{C}", "C"),
        (r"\boxed{(B)}", "B"),
        (r"$\boxed{\text{D}}$", "D"),
        (r"\boxed{C: Photon}", "C"),
        (r"\boxed{c}", "C"),
        ("Answer: (C)", "C"),
        ("**Answer:** C", "C"),
        ("Answer: **D**", "D"),
        ("ANSWER: C", "C"),
        ("The answer is C.", "C"),
        ("The answer is A.", "A"),
        ("Therefore the answer is: A", "A"),
        ("So the correct option is B", "B"),
        ("The answer is option D", "D"),
        ("A good answer needs care. Answer: B", "B"),
        ("The answer is A bit unclear; I pick (B)", "B"),
        ("I rule out (A) and (D); (C) fits best.", "C"),
        ("Option B fits best.", "B"),
        ("Final answer\n\nC", "C"),
        ("After all that:\n**B**\n", "B"),
        ("<think>the answer is A</think>The answer is D", "D"),
    ],
)
def test_gpqa_extracts_the_chosen_letter(response, expected):
    assert extract_gpqa_letter(response) == expected


@pytest.mark.parametrize(
    "response",
    [
        "A photon carries the force.",  # the article "A"
        "As a result, I am not sure.",
        "The answer is a photon.",
        "A) photon\nB) gluon\nC) W boson\nD) graviton\n",  # restating the options is not choosing one
        r"\boxed{E}",
        r"\boxed{photon}",
        r"\boxed{A or B}",
        "the answer is (a)",  # lower-case letters are not options outside \boxed
        "",
        None,
    ],
)
def test_gpqa_finds_no_letter_where_none_is_chosen(response):
    assert extract_gpqa_letter(response) is None


def test_gpqa_rule_judge_and_hle_has_no_rule_judge():
    assert rule_judge("gpqa", "The answer is (B).", "B").correct
    assert not rule_judge("gpqa", "The answer is (B).", "C").correct
    with pytest.raises(EvalError, match="hle has no rule judge.*free-form"):
        rule_judge("hle", "Exact Answer: W", "W")


@pytest.mark.parametrize(
    ("reply", "verdict"),
    [
        ("yes", True),
        ("Yes.", True),
        ("YES!", True),
        ("**No**", False),
        (" no\n", False),
        ("'no'", False),
        ("<think>hmm, close enough</think>yes", True),
        ("yes, because the numbers match", None),
        ("maybe", None),
        ("The answer is correct", None),
        ("yes no", None),
        ("N\ufffd\ufffdesul7", None),
        ("", None),
        (None, None),
    ],
)
def test_llm_verdicts_are_parsed_strictly(reply, verdict):
    assert parse_verdict(reply) is verdict
