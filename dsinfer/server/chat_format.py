"""DeepSeek-V4 / V4.1 chat prompts from OpenAI-style messages.

DeepSeek ships no Jinja chat template: a prompt is the concatenation of control tokens and message text, and
the exact spelling matters because the model was trained on it.  The rules below follow DeepSeek's
``deepseek-recipe`` (``deepseek-recipe-encoding/src/v4/mod.rs`` with ``dsv4.rs`` / ``dsv41.rs``, and the
Chat Completions request conversion: ``transform_messages``, ``convert_tools``, ``to_reasoning_effort``):

* ``<｜begin▁of▁sentence｜>`` first, then the turns, then ``<｜Assistant｜>`` + ``<think>`` (thinking mode)
  or ``<｜Assistant｜>`` + ``</think>`` (chat mode) as the generation prompt.
* The first system message carries the "## Tools" section and the "## Response Format:" section; V4.1 opens
  system text with ``<｜System｜>``, V4 writes it bare right after the bos token.
* Thinking mode puts a reasoning-effort preamble in front of the first message.
* User and tool turns open with ``<｜User｜>``; consecutive ones are joined by a blank line, tool results are
  wrapped in ``<tool_result>...</tool_result>`` and put in the order of the calls that asked for them.
* Earlier assistant turns are ``<｜Assistant｜>`` + (``<think>reasoning</think>`` in thinking mode, else
  ``</think>``) + content + the DSML tool-call block + ``<｜end▁of▁sentence｜>``.  Reasoning of earlier turns
  is kept (the recipe never drops it).

:func:`render_chat` returns :class:`Segment` pieces that say which text is ours (template: may contain
control tokens) and which came from the request (must be tokenized as plain characters, so that nobody can
forge ``<｜User｜>`` by typing it).  :func:`encode_chat` turns them into token ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from dsinfer.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    DSML_TOKEN,
    EOS_TOKEN,
    LATEST_REMINDER_TOKEN,
    SYSTEM_TOKEN,
    THINK_END_TOKEN,
    THINK_START_TOKEN,
    USER_TOKEN,
    Tokenizer,
)

__all__ = [
    "DsmlTags",
    "REASONING_EFFORTS",
    "Segment",
    "Variant",
    "dsml_tags",
    "encode_chat",
    "encode_segments",
    "render_chat",
    "segments_text",
]

Variant = Literal["v4", "v41"]

#: Accepted ``reasoning_effort`` values.  The recipe maps OpenAI's scale onto three levels:
#: minimal/low -> low, medium/high/xhigh -> high, max -> max (``ChatCompletionReasoningEffort``).
REASONING_EFFORTS = ("minimal", "low", "medium", "high", "xhigh", "max")
_EFFORT_LEVEL = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "xhigh": "high", "max": "max"}

# V4 (dsv4.rs): low adds nothing, high (the default) and max add a paragraph.
_V4_EFFORT_TEXT = {
    "low": "",
    "high": (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
        "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
        "scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
        "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
    ),
    "max": (
        "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
        "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
        "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
        "resolve the underlying cause rather than any surface symptom.\n"
        "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
        "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
    ),
}
# V4.1 (dsv41.rs): one line with a score.
_V41_EFFORT_SCORE = {"low": 50, "high": 75, "max": 100}

_RESPONSE_FORMAT_HEADER = "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


@dataclass(frozen=True, slots=True)
class Segment:
    """One piece of a rendered prompt.

    ``trusted`` text is ours (template, control tokens allowed); untrusted text came from the request and is
    tokenized as plain characters so it can never produce a control token.
    """

    text: str
    trusted: bool


@dataclass(frozen=True, slots=True)
class DsmlTags:
    """The DSML tool-call tag spellings of one variant (V4.1 writes a space after ``｜DSML｜``)."""

    block: str  # "tool_calls" / " calls"
    invoke: str  # "invoke" / " invoke"
    parameter: str  # "parameter" / " parameter"

    @property
    def block_open(self) -> str:
        return f"<{DSML_TOKEN}{self.block}>"

    @property
    def block_close(self) -> str:
        return f"</{DSML_TOKEN}{self.block}>"


@dataclass(frozen=True, slots=True)
class _Dialect:
    system_token: str  # written before system text; "" in V4
    mid_conversation_system: bool  # V4.1 keeps later system turns; V4 turns them into user text
    tags: DsmlTags


_DIALECTS: dict[str, _Dialect] = {
    "v4": _Dialect("", False, DsmlTags("tool_calls", "invoke", "parameter")),
    "v41": _Dialect(SYSTEM_TOKEN, True, DsmlTags(" calls", " invoke", " parameter")),
}


def _dialect(variant: str) -> _Dialect:
    try:
        return _DIALECTS[variant]
    except KeyError:
        raise ValueError(f"unknown chat format variant {variant!r}: expected 'v4' or 'v41'") from None


def dsml_tags(variant: Variant) -> DsmlTags:
    """The tool-call tag spellings the model writes for ``variant``."""
    return _dialect(variant).tags


# ---------------------------------------------------------------------------------------------- messages
@dataclass
class _ToolCall:
    id: str | None
    name: str
    arguments: Any  # the JSON string as sent (or an already-parsed object)


@dataclass
class _Message:
    """A turn after validation and the recipe's normalization."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    reasoning: str | None = None
    tool_calls: list[_ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    appendix: list[Segment] = field(default_factory=list)  # tools / response-format sections of the system turn


def _text(content: Any, where: str) -> str:
    """Message text: a string, a list of text parts (joined by a blank line, as the recipe does) or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for number, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.content[{number}]: only text parts ({{'type': 'text', ...}}) are supported")
            texts.append(part["text"])
        return "\n\n".join(texts)
    raise ValueError(f"{where}.content must be a string, a list of text parts or null")


def _tool_calls_in(raw: Any, where: str) -> list[_ToolCall]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    calls = []
    for number, call in enumerate(raw):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{number}] needs function.name")
        calls.append(_ToolCall(call.get("id"), function["name"], function.get("arguments", "{}")))
    ids = [call.id for call in calls if call.id is not None]
    if len(ids) != len(set(ids)):
        raise ValueError(f"{where}.tool_calls: duplicate tool call id")
    return calls


def _convert_messages(messages: Sequence[Mapping[str, Any]]) -> list[_Message]:
    """Validate the conversation and turn it into :class:`_Message` turns.

    Mirrors the recipe's ``transform_messages``: an assistant turn with tool calls must be followed by one
    tool message per call; a tool message anywhere else is an error; empty system turns are dropped.
    """
    if not messages:
        raise ValueError("messages must contain at least one message")
    result: list[_Message] = []
    index = 0
    while index < len(messages):
        message = messages[index]
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be an object")
        role = message.get("role")
        index += 1
        if role in ("system", "developer"):
            # OpenAI's "developer" is the system role of newer models.
            content = _text(message.get("content"), where)
            if content:
                result.append(_Message("system", content))
        elif role == "user":
            result.append(_Message("user", _text(message.get("content"), where)))
        elif role == "assistant":
            calls = _tool_calls_in(message.get("tool_calls"), where)
            if message.get("content") is None and not calls:
                raise ValueError(f"{where}: an assistant message needs content or tool_calls")
            reasoning = message.get("reasoning_content")
            if reasoning is not None and not isinstance(reasoning, str):
                raise ValueError(f"{where}.reasoning_content must be a string")
            result.append(_Message("assistant", _text(message.get("content"), where), reasoning, calls))
            index = _take_tool_results(messages, index, calls, result)
        elif role == "tool":
            raise ValueError(f"{where}: a tool message must answer a preceding assistant message with tool_calls")
        else:
            raise ValueError(f"{where}: unknown role {role!r} (expected system, developer, user, assistant or tool)")
    return result


def _take_tool_results(
    messages: Sequence[Mapping[str, Any]], index: int, calls: list[_ToolCall], result: list[_Message]
) -> int:
    """Consume the tool messages answering ``calls``; return the index after them."""
    wanted = {call.id for call in calls if call.id is not None}
    answered: set[str] = set()
    for _ in calls:
        message = messages[index] if index < len(messages) else None
        where = f"messages[{index}]"
        if not isinstance(message, Mapping) or message.get("role") != "tool":
            raise ValueError(
                f"{where}: an assistant message with tool_calls must be followed by one tool message per call "
                f"({len(calls)} expected)"
            )
        call_id = message.get("tool_call_id")
        if wanted and call_id not in wanted:
            raise ValueError(f"{where}: tool_call_id {call_id!r} does not match any call of the assistant message")
        if call_id is not None and call_id in answered:
            raise ValueError(f"{where}: tool_call_id {call_id!r} is answered twice")
        if call_id is not None:
            answered.add(call_id)
        result.append(_Message("tool", _text(message.get("content"), where), tool_call_id=call_id))
        index += 1
    return index


def _normalize(messages: list[_Message], dialect: _Dialect) -> list[_Message]:
    """The recipe's ``normalize_messages``: merge leading system turns (V4), demote later ones to user text
    (V4), merge consecutive user turns, and order tool results like the calls."""
    normalized: list[_Message] = []
    seen_non_system = False
    for message in messages:
        if message.role == "system" and not dialect.mid_conversation_system:
            if seen_non_system:
                normalized.append(_Message("user", message.content))
            elif normalized:
                normalized[-1].content += "\n\n" + message.content
            else:
                normalized.append(message)
        elif message.role == "user" and normalized and normalized[-1].role == "user":
            seen_non_system = True
            normalized[-1].content += "\n\n" + message.content
        else:
            seen_non_system |= message.role != "system"
            normalized.append(message)
    _sort_tool_results(normalized)
    return normalized


def _sort_tool_results(messages: list[_Message]) -> None:
    """Put each run of tool results in the order of the calls of the assistant turn before it."""
    order: dict[str | None, int] = {}
    start = 0
    while start < len(messages):
        if messages[start].role == "assistant":
            if messages[start].tool_calls:
                order = {call.id: position for position, call in enumerate(messages[start].tool_calls)}
            start += 1
            continue
        end = start
        while end < len(messages) and messages[end].role in ("user", "tool"):
            end += 1
        slots = [i for i in range(start, end) if messages[i].role == "tool"]
        if len(slots) > 1 and order:
            ordered = sorted((messages[i] for i in slots), key=lambda m: order.get(m.tool_call_id, 0))
            for slot, message in zip(slots, ordered, strict=True):
                messages[slot] = message
        start = max(end, start + 1)


# ---------------------------------------------------------------------------------------------- sections
class _Builder:
    """Collects segments, dropping empty ones and merging neighbours of the same trust."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    def add(self, text: str, trusted: bool) -> None:
        if not text:
            return
        if self.segments and self.segments[-1].trusted == trusted:
            self.segments[-1] = Segment(self.segments[-1].text + text, trusted)
        else:
            self.segments.append(Segment(text, trusted))

    def template(self, text: str) -> None:
        self.add(text, True)

    def content(self, text: str) -> None:
        self.add(text, False)

    def extend(self, segments: Sequence[Segment]) -> None:
        for segment in segments:
            self.add(segment.text, segment.trusted)


def _to_json(value: Any) -> str:
    """JSON as the recipe writes it (``stringify_python_style``): ``", "`` / ``": "`` separators, keys in
    their given order, non-ASCII text unescaped -- i.e. Python's ``json.dumps`` defaults."""
    return json.dumps(value, ensure_ascii=False)


def _tool_definitions(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``{name, description, parameters}`` of each OpenAI function tool (the recipe's ``ToolDefinition``)."""
    definitions = []
    names: set[str] = set()
    for number, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        is_function = isinstance(tool, Mapping) and tool.get("type", "function") == "function"
        if not is_function or not isinstance(function, Mapping):
            raise ValueError(f"tools[{number}] must be {{'type': 'function', 'function': {{...}}}}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{number}].function.name must be a non-empty string")
        if name in names:
            raise ValueError(f"tools[{number}].function.name {name!r} is defined twice")
        names.add(name)
        parameters = function.get("parameters")
        definitions.append(
            {
                "name": name,
                "description": function.get("description") or "",
                "parameters": {} if parameters is None else parameters,
            }
        )
    return definitions


def _tools_section(definitions: list[dict[str, Any]], tags: DsmlTags) -> list[Segment]:
    """The "## Tools" section (the recipe's ``render_tool_prompt``); tool schemas are request text."""
    block, invoke, parameter = DSML_TOKEN + tags.block, DSML_TOKEN + tags.invoke, DSML_TOKEN + tags.parameter
    head = (
        "\n\n## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke tools by writing "
        f'a "<{block}>" block like the following:\n\n'
        f"<{block}>\n"
        f'<{invoke} name="$TOOL_NAME">\n'
        f'<{parameter} name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{parameter}>\n'
        "...\n"
        f"</{invoke}>\n"
        f'<{invoke} name="$TOOL_NAME2">\n'
        "...\n"
        f"</{invoke}>\n"
        f"</{block}>\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
        'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
        f"If thinking_mode is enabled (triggered by {THINK_START_TOKEN}), you MUST output your complete reasoning "
        f"inside {THINK_START_TOKEN}...{THINK_END_TOKEN} BEFORE any tool calls or final response.\n\n"
        f"Otherwise, output directly after {THINK_END_TOKEN} with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
    )
    tail = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    builder = _Builder()
    builder.template(head)
    builder.content("\n".join(_to_json(definition) for definition in definitions))
    builder.template(tail)
    return builder.segments


def _response_format_section(response_format: Mapping[str, Any]) -> list[Segment]:
    """The "## Response Format:" section.

    ``json_object`` renders ``{"type": "json_object"}`` exactly as the recipe does.  The recipe ignores
    ``json_schema``; we show the model the JSON Schema itself, which is what "the following schema" asks for.
    """
    kind = response_format.get("type")
    if kind == "json_object":
        schema: Any = {"type": "json_object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema (an object)")
        schema = spec["schema"]
    else:
        raise ValueError(f"response_format type {kind!r} is not supported (json_object or json_schema)")
    return [Segment(_RESPONSE_FORMAT_HEADER, True), Segment(_to_json(schema), False)]


def _effort_preamble(variant: str, level: str) -> str:
    if variant == "v4":
        return _V4_EFFORT_TEXT[level]
    score = _V41_EFFORT_SCORE[level]
    return f"Reasoning Effort: {score} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


def _tool_arguments(arguments: Any) -> dict[str, Any]:
    """Arguments as an object; anything that is not a JSON object becomes ``{"arguments": <raw>}`` (recipe)."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
    return {"arguments": arguments if isinstance(arguments, str) else _to_json(arguments)}


def _add_tool_calls(builder: _Builder, calls: list[_ToolCall], tags: DsmlTags) -> None:
    """A DSML tool-call block; tags are template, names and values are request text."""
    invoke, parameter = DSML_TOKEN + tags.invoke, DSML_TOKEN + tags.parameter
    builder.template(f"\n\n{tags.block_open}\n")
    for number, call in enumerate(calls):
        if number:
            builder.template("\n")
        builder.template(f'<{invoke} name="')
        builder.content(call.name)
        builder.template('">\n')
        for position, (key, value) in enumerate(_tool_arguments(call.arguments).items()):
            is_string = isinstance(value, str)
            if position:
                builder.template("\n")
            builder.template(f'<{parameter} name="')
            builder.content(key)
            builder.template(f'" string="{"true" if is_string else "false"}">')
            builder.content(value if is_string else _to_json(value))
            builder.template(f"</{parameter}>")
        builder.template(f"\n</{invoke}>")
    builder.template(f"\n{tags.block_close}")


# ---------------------------------------------------------------------------------------------- rendering
def _tool_choice_mode(tool_choice: Any, definitions: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """("auto" | "none" | "required", tools to show).  A named choice shows only that tool and forces a call."""
    if tool_choice is None or tool_choice == "auto":
        return "auto", definitions
    if tool_choice == "none":
        return "none", []
    if tool_choice == "required":
        if not definitions:
            raise ValueError("tool_choice is 'required' but no tools are defined")
        return "required", definitions
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}")
    chosen = [definition for definition in definitions if definition["name"] == name]
    if not chosen:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
    return "required", chosen


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    variant: Variant,
    thinking: bool,
    reasoning_effort: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    response_format: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    tool_choice: str | Mapping[str, Any] | None = None,
) -> list[Segment]:
    """Render a chat as prompt segments (see the module docstring for the format).

    ``reasoning_effort`` only matters in thinking mode (default there: high).  ``tool_choice`` "none" hides the
    tools; "required" (or a named function) ends the prompt inside an opened tool-call block, which the recipe
    allows only in chat mode.  Raises ``ValueError`` naming the problem for a conversation that cannot be
    rendered.
    """
    dialect = _dialect(variant)
    if reasoning_effort is not None and reasoning_effort not in _EFFORT_LEVEL:
        raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {reasoning_effort!r}")
    definitions = _tool_definitions(tools or [])
    choice, definitions = _tool_choice_mode(tool_choice, definitions)
    if choice == "required" and thinking:
        raise ValueError("a required or named tool_choice is not supported in thinking mode")
    if response_format is not None and response_format.get("type") == "text":
        response_format = None

    turns = _normalize(_convert_messages(messages), dialect)
    if definitions or response_format is not None:
        if turns[0].role != "system":
            turns.insert(0, _Message("system", ""))
        if definitions:
            turns[0].appendix.extend(_tools_section(definitions, dialect.tags))
        if response_format is not None:
            turns[0].appendix.extend(_response_format_section(response_format))

    effort = _effort_preamble(variant, _EFFORT_LEVEL[reasoning_effort or "high"]) if thinking else ""
    builder = _Builder()
    builder.template(BOS_TOKEN)
    for index, turn in enumerate(turns):
        if index == 0:
            if effort or turn.role == "system":
                builder.template(dialect.system_token)
            builder.template(effort)
        previous = turns[index - 1].role if index else None
        _add_turn(builder, turn, index, previous, thinking, dialect)
    if add_generation_prompt:
        builder.template(ASSISTANT_TOKEN + (THINK_START_TOKEN if thinking else THINK_END_TOKEN))
        if choice == "required":
            builder.template(f"\n\n{dialect.tags.block_open}\n")
    return builder.segments


def _add_turn(
    builder: _Builder, turn: _Message, index: int, previous: str | None, thinking: bool, dialect: _Dialect
) -> None:
    """One turn (the recipe's ``render_message_segments``)."""
    if turn.role == "system":
        if index > 0 and dialect.mid_conversation_system:
            builder.template(dialect.system_token)
        builder.content(turn.content)
        builder.extend(turn.appendix)
    elif turn.role in ("user", "tool"):
        builder.template("\n\n" if previous in ("user", "tool") else USER_TOKEN)
        if turn.role == "tool":
            builder.template("<tool_result>")
            builder.content(turn.content)
            builder.template("</tool_result>")
        else:
            builder.content(turn.content)
    else:
        builder.template(ASSISTANT_TOKEN)
        if thinking and index > 0:
            builder.template(THINK_START_TOKEN)
            builder.content(turn.reasoning or "")
        builder.template(THINK_END_TOKEN)
        builder.content(turn.content)
        if turn.tool_calls:
            _add_tool_calls(builder, turn.tool_calls, dialect.tags)
        builder.template(EOS_TOKEN)


def segments_text(segments: Sequence[Segment]) -> str:
    """The prompt as one string (for logs, tests and the /tokenize endpoint)."""
    return "".join(segment.text for segment in segments)


# ---------------------------------------------------------------------------------------------- tokens
_CONTROL_TOKENS = (
    BOS_TOKEN,
    EOS_TOKEN,
    SYSTEM_TOKEN,
    USER_TOKEN,
    ASSISTANT_TOKEN,
    LATEST_REMINDER_TOKEN,
    THINK_START_TOKEN,
    THINK_END_TOKEN,
    DSML_TOKEN,
)
_CONTROL_PATTERN = re.compile("|".join(re.escape(t) for t in sorted(_CONTROL_TOKENS, key=len, reverse=True)))


def _split_control(text: str) -> Iterator[tuple[str, bool]]:
    """Template text cut into (control token, True) and (plain text, False) pieces."""
    position = 0
    for match in _CONTROL_PATTERN.finditer(text):
        if match.start() > position:
            yield text[position : match.start()], False
        yield match.group(), True
        position = match.end()
    if position < len(text):
        yield text[position:], False


def encode_segments(tokenizer: Tokenizer, segments: Sequence[Segment]) -> list[int]:
    """Token ids for rendered segments.

    Control tokens are recognized only in template text.  All other text between two control tokens --
    template and request text alike -- is encoded together as plain characters.  That equals tokenizing the
    whole prompt string at once (how the model was trained: the tokenizer cuts at added tokens first), except
    that a control-token spelling inside request text stays ordinary characters.
    """
    ids: list[int] = []
    pending: list[str] = []
    control_ids: dict[str, int] = {}

    def flush() -> None:
        if pending:
            ids.extend(tokenizer.encode("".join(pending), allow_special=False))
            pending.clear()

    for segment in segments:
        if not segment.trusted:
            pending.append(segment.text)
            continue
        for piece, is_control in _split_control(segment.text):
            if not is_control:
                pending.append(piece)
                continue
            if piece not in control_ids:
                control_ids[piece] = _control_id(tokenizer, piece)
            flush()
            ids.append(control_ids[piece])
    flush()
    return ids


def _control_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None or tokenizer.encode(token, allow_special=True) != [token_id]:
        raise ValueError(f"the tokenizer has no {token!r} control token, which this chat format needs")
    return token_id


def encode_chat(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    variant: Variant,
    thinking: bool,
    reasoning_effort: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    response_format: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    tool_choice: str | Mapping[str, Any] | None = None,
) -> list[int]:
    """Prompt token ids for a chat: :func:`render_chat` then :func:`encode_segments`."""
    segments = render_chat(
        messages,
        variant=variant,
        thinking=thinking,
        reasoning_effort=reasoning_effort,
        tools=tools,
        response_format=response_format,
        add_generation_prompt=add_generation_prompt,
        tool_choice=tool_choice,
    )
    return encode_segments(tokenizer, segments)
