"""From a chat request to what the engine and the output parser need: prompt ids, mode, tools, grammar."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dsinfer.server.chat_format import encode_chat
from dsinfer.server.protocol import ChatCompletionRequest
from dsinfer.server.response_parser import ResponseParser
from dsinfer.tokenizer import THINK_END_TOKEN, Tokenizer


@dataclass
class ChatOptions:
    prompt_ids: list[int]
    thinking: bool
    tools_enabled: bool
    structured_output: object | None  # dsinfer.sampling_params.StructuredOutput
    parser: Callable[[], ResponseParser]


def chat_options(body: ChatCompletionRequest, tokenizer: Tokenizer, variant: str = "v4") -> ChatOptions:
    """Render the conversation (tools, response format, thinking mode) and prepare the output side."""
    thinking = body.thinking()
    tools = [tool.model_dump() for tool in body.tools or []]
    choice = body.tool_choice
    if choice == "none":
        tools = []
    elif choice is not None and not isinstance(choice, str):
        wanted = choice.function.get("name")
        tools = [t for t in tools if t["function"]["name"] == wanted]
        if not tools:
            raise ValueError(f"tool_choice names the function {wanted!r}, which is not among the request's tools")
    elif choice == "required" and not tools:
        raise ValueError("tool_choice is 'required' but the request defines no tools")
    forced = choice == "required" or (choice is not None and not isinstance(choice, str))
    if forced and thinking:
        raise ValueError("tool_choice 'required' or a named function cannot be combined with thinking mode")
    response_format = body.response_format.model_dump(by_alias=True) if body.response_format else None
    if response_format and response_format["type"] == "text":
        response_format = None
    messages = [message.model_dump(exclude_none=True) for message in body.messages]
    prompt_ids = encode_chat(
        tokenizer,
        messages,
        variant=variant,
        thinking=thinking,
        reasoning_effort=body.reasoning_effort,
        tools=tools or None,
        response_format=response_format,
        tool_choice="required" if forced else None,
    )
    structured = _structured_output(response_format, tokenizer, thinking)
    tools_enabled = bool(tools)

    def parser() -> ResponseParser:
        return ResponseParser(variant, thinking=thinking, tools_enabled=tools_enabled, starts_in_tool_calls=forced)

    return ChatOptions(prompt_ids, thinking, tools_enabled, structured, parser)


def _structured_output(response_format: dict | None, tokenizer: Tokenizer, thinking: bool):
    """An xgrammar constraint for json_object / json_schema, applied after ``</think>`` in thinking mode."""
    if response_format is None:
        return None
    from dsinfer.sampling_params import StructuredOutput

    start_after = tokenizer.token_to_id(THINK_END_TOKEN) if thinking else None
    if response_format["type"] == "json_object":
        return StructuredOutput(kind="json_object", spec=None, start_after_token=start_after)
    schema = response_format["json_schema"]["schema"]
    return StructuredOutput(kind="json_schema", spec=schema, start_after_token=start_after)
