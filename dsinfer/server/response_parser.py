"""Split DeepSeek-V4 / V4.1 output text into reasoning, answer content and tool calls, as it streams.

The rules follow DeepSeek's ``deepseek-recipe`` output state machine (``deepseek-recipe/src/stream/
state_machine.rs``):

* Thinking mode starts inside the reasoning (the prompt ended with ``<think>``); reasoning runs until
  ``</think>``.  Newlines right before ``</think>`` are dropped, and so are leading newlines of the reasoning
  and of the answer that follows.
* In the answer a ``</think>`` is a stray control token and is dropped (in chat mode the prompt already ended
  with ``</think>``, and models sometimes repeat it).
* With tools, ``<｜DSML｜`` (in the answer, or in the reasoning) opens the tool-call block; the newlines before
  it are dropped.  Each ``invoke`` becomes one :class:`ToolCall`, emitted when its closing tag arrives, with
  its parameters rebuilt as a JSON object: ``string="true"`` values are raw strings, others are parsed as JSON
  (and kept as a string when they are not valid JSON).  Text after the closed block is ignored.
* V4 spells the block ``<｜DSML｜tool_calls>`` / ``<｜DSML｜invoke ...>``, V4.1 ``<｜DSML｜ calls>`` /
  ``<｜DSML｜ invoke ...>``; like the recipe, the parser accepts both spellings whatever the variant.

Text that could still turn out to be the start of ``</think>`` or of a DSML tag is held back until the next
delta decides it, so no delta ever carries part of a control tag; :meth:`ResponseParser.finish` releases what
is left.  Streaming a text in any pieces yields exactly what :func:`parse_complete` returns for the whole.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from dsinfer.server.chat_format import Variant, dsml_tags
from dsinfer.tokenizer import DSML_TOKEN, THINK_END_TOKEN

__all__ = ["ParsedDelta", "ParsedMessage", "ResponseParser", "ToolCall", "new_tool_call_id", "parse_complete"]

_DSML_OPEN = "<" + DSML_TOKEN
_DSML = re.escape(DSML_TOKEN)
# The optional space is V4.1's spelling; the parser takes both variants' tags.
_INVOKE_OPEN = re.compile(rf'<{_DSML} ?invoke name="([^"]*)">')
_INVOKE_CLOSE = re.compile(rf"</{_DSML} ?invoke>")
_BLOCK_CLOSE = re.compile(rf"</{_DSML} ?(?:tool_calls|calls)>")
_PARAMETER = re.compile(
    rf'<{_DSML} ?parameter name="([^"]*)"(?: string="(true|false)")?>(.*?)</{_DSML} ?parameter>', re.DOTALL
)
# Longest closing tag ("</｜DSML｜ tool_calls>" is 21 characters): how far back a resumed search must look.
_CLOSE_TAG_REACH = 32


def new_tool_call_id() -> str:
    """A fresh OpenAI-style tool call id (``call_`` and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed tool call; ``arguments`` is JSON object text, ``index`` its position in the response."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ParsedDelta:
    """What one :meth:`ResponseParser.feed` / :meth:`~ResponseParser.finish` call added: new pieces only."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass(slots=True)
class ParsedMessage:
    """A whole response: ``None`` stands for "nothing of this kind"."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


@dataclass(frozen=True, slots=True)
class _Marker:
    text: str
    eats_newlines: bool  # the newlines right before the marker belong to it (and are dropped)


_THINK_END_IN_REASONING = _Marker(THINK_END_TOKEN, eats_newlines=True)
_THINK_END_IN_CONTENT = _Marker(THINK_END_TOKEN, eats_newlines=False)
_TOOL_BLOCK_START = _Marker(_DSML_OPEN, eats_newlines=True)

_State = Literal["reasoning", "content", "tools", "done"]


class ResponseParser:
    """Incremental parser for one generated response (one choice).

    ``thinking``: the prompt ended with ``<think>`` (the text starts inside the reasoning).  ``tools_enabled``:
    the request offered tools, so DSML tool-call blocks are parsed (otherwise they stay plain text, as in the
    recipe).  ``starts_in_tool_calls``: the prompt already opened the tool-call block (forced tool choice).
    ``id_factory`` makes tool call ids (tests pass a deterministic one).  ``variant`` is checked, but like the
    recipe the parser accepts both the V4 and the V4.1 tag spellings.
    """

    def __init__(
        self,
        variant: Variant,
        thinking: bool,
        tools_enabled: bool,
        *,
        id_factory: Callable[[], str] | None = None,
        starts_in_tool_calls: bool = False,
    ) -> None:
        dsml_tags(variant)  # validates the variant
        self._tools_enabled = tools_enabled
        self._new_id = id_factory or new_tool_call_id
        self._state: _State
        if starts_in_tool_calls and tools_enabled:
            self._state = "tools"
        else:
            self._state = "reasoning" if thinking else "content"
        self._leading = True  # leading newlines of the reasoning / answer are dropped
        self._buffer = ""  # text not yet decided
        self._search_from = 0  # where to resume looking for an invoke's closing tag in _buffer
        self._tool_count = 0
        self._finished = False

    # ------------------------------------------------------------------ public
    def feed(self, text_delta: str) -> ParsedDelta:
        """Take the next piece of generated text; return the reasoning / content / tool calls it completes."""
        if self._finished:
            raise RuntimeError("ResponseParser.feed() called after finish()")
        self._buffer += text_delta
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        """End of output: release held-back text.  An ``invoke`` that never closed is dropped (cut off)."""
        if self._finished:
            return ParsedDelta()
        delta = self._run(final=True)
        self._finished = True
        return delta

    @property
    def in_reasoning(self) -> bool:
        """Whether the text so far ended inside the reasoning."""
        return self._state == "reasoning"

    # ------------------------------------------------------------------ state machine
    def _run(self, final: bool) -> ParsedDelta:
        delta = ParsedDelta()
        while True:
            if self._state in ("reasoning", "content"):
                progressed = self._step_text(delta, final)
            elif self._state == "tools":
                progressed = self._step_tools(delta, final)
            else:  # done: whatever follows the tool-call block is not part of the message
                self._buffer = ""
                progressed = False
            if not progressed:
                return delta

    def _markers(self) -> tuple[_Marker, ...]:
        think_end = _THINK_END_IN_REASONING if self._state == "reasoning" else _THINK_END_IN_CONTENT
        return (think_end, _TOOL_BLOCK_START) if self._tools_enabled else (think_end,)

    def _step_text(self, delta: ParsedDelta, final: bool) -> bool:
        """Emit reasoning / answer text up to the next marker; return True after a marker changed the state."""
        if self._leading:
            self._buffer = self._buffer.lstrip("\n")
        buffer = self._buffer
        if not buffer:
            return False
        markers = self._markers()
        found = _earliest_marker(buffer, markers)
        if found is None:
            keep = len(buffer) if final else _held_back_from(buffer, markers)
            self._emit(delta, buffer[:keep])
            self._buffer = buffer[keep:]
            return False
        start, tag_start, marker = found
        self._emit(delta, buffer[:start])
        if marker is _TOOL_BLOCK_START:
            self._buffer = buffer[tag_start:]
            self._search_from = 0
            self._state = "tools"
        else:
            self._buffer = buffer[tag_start + len(marker.text) :]
            if self._state == "reasoning":
                self._state = "content"
                self._leading = True
        return True

    def _emit(self, delta: ParsedDelta, text: str) -> None:
        if not text:
            return
        self._leading = False
        if self._state == "reasoning":
            delta.reasoning += text
        else:
            delta.content += text

    def _step_tools(self, delta: ParsedDelta, final: bool) -> bool:
        """Emit the next complete ``invoke``; return True when something was consumed."""
        buffer = self._buffer
        opener = _INVOKE_OPEN.match(buffer)  # the buffer starts at an invoke while its closing tag is awaited
        if opener is None:
            opener = _INVOKE_OPEN.search(buffer)
            block_close = _BLOCK_CLOSE.search(buffer)
            if block_close is not None and (opener is None or block_close.start() < opener.start()):
                self._state, self._buffer = "done", ""
                return True
            if opener is None:
                if final:
                    self._state, self._buffer = "done", ""
                else:
                    self._buffer = buffer[_junk_end(buffer) :]
                return False
            self._buffer = buffer = buffer[opener.start() :]
            self._search_from = 0
            opener = _INVOKE_OPEN.match(buffer)
            if opener is None:  # pragma: no cover - the same pattern matched a moment ago
                raise AssertionError("invoke tag lost while re-basing the buffer")
        search_from = max(opener.end(), self._search_from)
        invoke_close = _INVOKE_CLOSE.search(buffer, search_from)
        block_close = _BLOCK_CLOSE.search(buffer, search_from)
        if invoke_close is not None and (block_close is None or invoke_close.start() < block_close.start()):
            delta.tool_calls.append(self._tool_call(opener.group(1), buffer[opener.end() : invoke_close.start()]))
            self._buffer = buffer[invoke_close.end() :]
            self._search_from = 0
            return True
        if block_close is not None:  # the block closed around an unclosed invoke: take what it holds
            delta.tool_calls.append(self._tool_call(opener.group(1), buffer[opener.end() : block_close.start()]))
            self._state, self._buffer = "done", ""
            return True
        if final:  # cut off inside an invoke: its arguments may be incomplete, so it is not a call
            self._state, self._buffer = "done", ""
        else:
            self._search_from = max(opener.end(), len(buffer) - _CLOSE_TAG_REACH)
        return False

    def _tool_call(self, name: str, body: str) -> ToolCall:
        arguments: dict[str, Any] = {}
        for match in _PARAMETER.finditer(body):
            key, is_string, raw = match.group(1), match.group(2), match.group(3)
            arguments[key] = raw if is_string == "true" else _json_or_string(raw)
        call = ToolCall(self._tool_count, self._new_id(), name, json.dumps(arguments, ensure_ascii=False))
        self._tool_count += 1
        return call


def _json_or_string(raw: str) -> Any:
    """A ``string="false"`` value: JSON when it parses, else kept as the text the model wrote.

    ``NaN`` / ``Infinity`` are not JSON (Python's parser accepts them), so they stay text too: the arguments
    we hand out must be valid JSON for any client.
    """
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        return raw


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _earliest_marker(buffer: str, markers: tuple[_Marker, ...]) -> tuple[int, int, _Marker] | None:
    """(start including eaten newlines, start of the tag, marker) of the first complete marker, or None."""
    best: tuple[int, int, _Marker] | None = None
    for marker in markers:
        tag_start = buffer.find(marker.text)
        if tag_start < 0:
            continue
        start = tag_start
        if marker.eats_newlines:
            while start > 0 and buffer[start - 1] == "\n":
                start -= 1
        if best is None or start < best[0]:
            best = (start, tag_start, marker)
    return best


def _held_back_from(buffer: str, markers: tuple[_Marker, ...]) -> int:
    """Index from which ``buffer`` might still become a marker (a proper prefix of one, or newlines a marker
    would eat); text before it is safe to emit."""
    hold = len(buffer)
    for marker in markers:
        start = len(buffer)
        for length in range(min(len(marker.text) - 1, len(buffer)), 0, -1):
            if buffer.endswith(marker.text[:length]):
                start = len(buffer) - length
                break
        if marker.eats_newlines:
            while start > 0 and buffer[start - 1] == "\n":
                start -= 1
        hold = min(hold, start)
    return hold


def _junk_end(buffer: str) -> int:
    """Inside the block but before any ``invoke``: where the text that may still start a tag begins."""
    tag = max(buffer.rfind(_DSML_OPEN), buffer.rfind("</" + DSML_TOKEN))
    if tag >= 0:
        return tag
    bracket = buffer.rfind("<")
    return bracket if bracket >= 0 else len(buffer)


def parse_complete(
    text: str,
    variant: Variant,
    thinking: bool,
    tools_enabled: bool,
    *,
    id_factory: Callable[[], str] | None = None,
    starts_in_tool_calls: bool = False,
) -> ParsedMessage:
    """Parse a whole response at once (non-streaming); equal to streaming it through :class:`ResponseParser`."""
    parser = ResponseParser(
        variant, thinking, tools_enabled, id_factory=id_factory, starts_in_tool_calls=starts_in_tool_calls
    )
    head, tail = parser.feed(text), parser.finish()
    reasoning, content = head.reasoning + tail.reasoning, head.content + tail.content
    return ParsedMessage(reasoning or None, content or None, head.tool_calls + tail.tool_calls)
