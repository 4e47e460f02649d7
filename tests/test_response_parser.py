"""Output parsing (dsinfer.server.response_parser): reasoning, answer and DSML tool calls, whole and streamed.

Behaviour follows DeepSeek's deepseek-recipe output state machine (deepseek-recipe/src/stream/state_machine.rs)
and its chunk-boundary test (deepseek-recipe/tests/stream_tool_calls.rs).
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass

import pytest

from dsinfer.server.response_parser import ParsedMessage, ResponseParser, ToolCall, new_tool_call_id, parse_complete


def counter_ids():
    numbers = itertools.count()
    return lambda: f"call_{next(numbers)}"


@dataclass
class Case:
    name: str
    text: str
    expected: ParsedMessage
    variant: str = "v4"
    thinking: bool = False
    tools: bool = True
    starts_in_tool_calls: bool = False

    def parser(self) -> ResponseParser:
        return ResponseParser(
            self.variant,
            self.thinking,
            self.tools,
            id_factory=counter_ids(),
            starts_in_tool_calls=self.starts_in_tool_calls,
        )

    def complete(self) -> ParsedMessage:
        return parse_complete(
            self.text,
            self.variant,
            self.thinking,
            self.tools,
            id_factory=counter_ids(),
            starts_in_tool_calls=self.starts_in_tool_calls,
        )


def call(index: int, name: str, arguments: dict) -> ToolCall:
    return ToolCall(index, f"call_{index}", name, json.dumps(arguments, ensure_ascii=False))


V4_CALLS = (
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">São Paulo\n"centre"</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="options" string="false">{"units": ["C", "F"], "alerts": true, "x": null}'
    "</｜DSML｜parameter>\n"
    '<｜DSML｜parameter name="note" string="false">not json at all</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="search">\n'
    '<｜DSML｜parameter name="query" string="true">42</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
V4_EXPECTED_CALLS = [
    call(
        0,
        "get_weather",
        {
            "city": 'São Paulo\n"centre"',
            "days": 3,
            "options": {"units": ["C", "F"], "alerts": True, "x": None},
            "note": "not json at all",
        },
    ),
    call(1, "search", {"query": "42"}),
]
V41_CALLS = (
    "<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="get_weather">\n'
    '<｜DSML｜ parameter name="city" string="true">São Paulo\n"centre"</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>\n'
    '<｜DSML｜ parameter name="options" string="false">{"units": ["C", "F"], "alerts": true, "x": null}'
    "</｜DSML｜ parameter>\n"
    '<｜DSML｜ parameter name="note" string="false">not json at all</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="search">\n'
    '<｜DSML｜ parameter name="query" string="true">42</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>"
)

CASES = [
    Case(
        "reasoning then answer",
        "\nThe user wants 2+2.\nThat is 4.\n\n</think>\n\nThe answer is **4**.\n\nAnything else?",
        ParsedMessage("The user wants 2+2.\nThat is 4.", "The answer is **4**.\n\nAnything else?", []),
        thinking=True,
    ),
    Case(
        "reasoning, answer and V4 tool calls",
        "I need the weather.</think>Let me check.\n\n" + V4_CALLS,
        ParsedMessage("I need the weather.", "Let me check.", V4_EXPECTED_CALLS),
        thinking=True,
    ),
    Case(
        "V4.1 spelling",
        "I need the weather.\n</think>\n\n" + V41_CALLS,
        ParsedMessage("I need the weather.", None, V4_EXPECTED_CALLS),
        variant="v41",
        thinking=True,
    ),
    Case(
        "chat mode tool calls, text after the block is ignored",
        "Sure.\n" + V4_CALLS + "\nThis trailing text is not part of the message.",
        ParsedMessage(None, "Sure.", V4_EXPECTED_CALLS),
    ),
    Case(
        "content only with look-alike characters",
        "a < b, x </ y, </div> and <｜ fullwidth, <｜DS and </thinking> stay text.\n\nEnd.",
        ParsedMessage(None, "a < b, x </ y, </div> and <｜ fullwidth, <｜DS and </thinking> stay text.\n\nEnd.", []),
    ),
    Case(
        "stray leading </think> in chat mode is swallowed",
        "</think>\n\nHello!",
        ParsedMessage(None, "Hello!", []),
    ),
    Case(
        "stray </think> inside the answer is dropped",
        "</think>Step one.</think> Step two.",
        ParsedMessage(None, "Step one. Step two.", []),
        thinking=True,
    ),
    Case(
        "tools disabled: DSML stays text",
        "Answer: <｜DSML｜tool_calls> is how calls look.",
        ParsedMessage(None, "Answer: <｜DSML｜tool_calls> is how calls look.", []),
        tools=False,
    ),
    Case(
        "tool call straight from the reasoning",
        "Calling now.\n\n" + V4_CALLS,
        ParsedMessage("Calling now.", None, V4_EXPECTED_CALLS),
        thinking=True,
    ),
    Case(
        "cut off in the reasoning",
        "\n\nStill thinking about </thi",
        ParsedMessage("Still thinking about </thi", None, []),
        thinking=True,
    ),
    Case(
        "cut off inside an invoke: only the finished call counts",
        "Checking.\n" + V4_CALLS[: V4_CALLS.index("</｜DSML｜invoke>\n</｜DSML｜tool_calls>") - 10],
        ParsedMessage(None, "Checking.", V4_EXPECTED_CALLS[:1]),
    ),
    Case(
        "block closes around an unclosed invoke",
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="ping">\n'
        '<｜DSML｜parameter name="host" string="true">a.b</｜DSML｜parameter>\n</｜DSML｜tool_calls>',
        ParsedMessage(None, None, [call(0, "ping", {"host": "a.b"})]),
    ),
    Case(
        "block never closed, invokes closed",
        'Go.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="noop">\n</｜DSML｜ invoke>\n',
        ParsedMessage(None, "Go.", [call(0, "noop", {})]),
        variant="v41",
    ),
    Case(
        "recipe's awkward parameter names survive",
        "<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="submit">\n'
        '<｜DSML｜ parameter name="shipping address" string="true">Paris\n日本</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name=" string= mode " string="false">{"enabled":true}</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="count" string="false">2</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="" string="true">empty key</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        "</｜DSML｜ calls>",
        ParsedMessage(
            None,
            None,
            [
                call(
                    0,
                    "submit",
                    {
                        "shipping address": "Paris\n日本",
                        " string= mode ": {"enabled": True},
                        "count": 2,
                        "": "empty key",
                    },
                )
            ],
        ),
        variant="v41",
    ),
    Case(
        "forced tool choice: the prompt opened the block",
        '<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="q" string="true">x</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
        ParsedMessage(None, None, [call(0, "search", {"q": "x"})]),
        starts_in_tool_calls=True,
    ),
    Case(
        "junk inside the block is skipped",
        '<｜DSML｜tool_calls>\nhmm < >\n<｜DSML｜invoke name="a">\n</｜DSML｜invoke>\nxx\n'
        '<｜DSML｜invoke name="b">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
        ParsedMessage(None, None, [call(0, "a", {}), call(1, "b", {})]),
    ),
    Case(
        "non-JSON constants stay strings",
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="x" string="false">NaN'
        '</｜DSML｜parameter>\n<｜DSML｜parameter name="y" string="false"> [1, 2.5] </｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="z">"quoted"</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>',
        ParsedMessage(None, None, [call(0, "f", {"x": "NaN", "y": [1, 2.5], "z": "quoted"})]),
    ),
    Case("empty output", "", ParsedMessage(None, None, []), thinking=True),
]


def markers(case: Case) -> list[str]:
    return ["</think>", "<｜DSML｜"] if case.tools else ["</think>"]


def stream(case: Case, pieces: list[str]) -> tuple[ParsedMessage, list]:
    """Feed ``pieces``; return the joined result and the (delta, raw text still to come) of every feed."""
    parser = case.parser()
    reasoning, content, calls, fed = "", "", [], []
    consumed = 0
    for piece in pieces:
        delta = parser.feed(piece)
        consumed += len(piece)
        fed.append((delta, case.text[consumed:]))
        reasoning, content, calls = reasoning + delta.reasoning, content + delta.content, calls + delta.tool_calls
    tail = parser.finish()
    reasoning, content, calls = reasoning + tail.reasoning, content + tail.content, calls + tail.tool_calls
    return ParsedMessage(reasoning or None, content or None, calls), fed + [(tail, "")]


def check_no_control_text(case: Case, deltas: list) -> None:
    """No delta carries a control tag, or the start of one that the following text completes."""
    for delta, rest in deltas:
        for text in (delta.reasoning, delta.content):
            assert "</think>" not in text
            if case.tools:
                assert "<｜DSML｜" not in text and "</｜DSML｜" not in text
            for marker in markers(case):
                for length in range(1, len(marker)):
                    if text.endswith(marker[:length]):
                        assert not rest.startswith(marker[length:]), (case.name, text, rest[:20])


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_whole_output_parses_to_the_expected_message(case):
    assert case.complete() == case.expected


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_every_two_piece_split_streams_the_same(case):
    expected = case.complete()
    for cut in range(len(case.text) + 1):
        result, deltas = stream(case, [case.text[:cut], case.text[cut:]])
        assert result == expected, (case.name, cut)
        check_no_control_text(case, deltas)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_character_by_character_and_random_splits_stream_the_same(case):
    expected = case.complete()
    result, deltas = stream(case, list(case.text))
    assert result == expected
    check_no_control_text(case, deltas)
    rng = random.Random(case.name)
    for _ in range(40):
        cuts = sorted(rng.sample(range(len(case.text) + 1), k=min(len(case.text) + 1, rng.randint(1, 12))))
        pieces = [case.text[a:b] for a, b in zip([0, *cuts], [*cuts, len(case.text)], strict=True)]
        result, deltas = stream(case, pieces)
        assert result == expected, (case.name, cuts)
        check_no_control_text(case, deltas)


def test_deltas_hold_only_new_pieces_and_calls_arrive_when_their_invoke_closes():
    parser = ResponseParser("v4", thinking=True, tools_enabled=True, id_factory=counter_ids())
    assert parser.feed("Think").reasoning == "Think"
    assert parser.in_reasoning
    delta = parser.feed("ing.</thi")
    assert (delta.reasoning, delta.content) == ("ing.", "")
    delta = parser.feed("nk>Done.\n")
    assert (delta.reasoning, delta.content) == ("", "Done.")
    assert not parser.in_reasoning
    delta = parser.feed('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" string="false">1')
    assert not delta  # the newline went with the block; the call is not complete yet
    delta = parser.feed("</｜DSML｜parameter>\n</｜DSML｜invoke>")
    assert delta.tool_calls == [call(0, "f", {"a": 1})]
    assert not parser.feed("\n</｜DSML｜tool_calls>and more")
    assert not parser.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        parser.feed("x")


def test_held_back_text_is_released_at_finish():
    parser = ResponseParser("v41", thinking=False, tools_enabled=True)
    assert parser.feed("Values:\n\n<｜DS").content == "Values:"
    assert parser.finish().content == "\n\n<｜DS"


def test_default_tool_call_ids_are_fresh_openai_style_ids():
    first, second = new_tool_call_id(), new_tool_call_id()
    assert first != second
    assert first.startswith("call_") and len(first) == 29 and int(first[5:], 16) >= 0
    parsed = parse_complete(V4_CALLS, "v4", thinking=False, tools_enabled=True)
    assert [c.index for c in parsed.tool_calls] == [0, 1]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_unknown_variant_is_rejected():
    with pytest.raises(ValueError, match="unknown chat format variant"):
        ResponseParser("v5", thinking=False, tools_enabled=False)
