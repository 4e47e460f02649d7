"""``LLM.chat``: conversations through the same deepseek-recipe path as the server's chat completions.

The conversation is converted and its prompt encoded by :class:`~dsinfer.chat.format.ChatFormat`, the
engine generates token ids, and the library's stream processor (:class:`~dsinfer.chat.stream.ChoiceStream`)
parses them exactly as ``/v1/chat/completions`` does: the reasoning up to ``</think>`` goes to ``reasoning``,
DSML tool calls to ``tool_calls``, the answer to ``text``; stop strings end the answer only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

import deepseek_recipe as recipe

from dsinfer.chat.format import ChatFormat, PreparedRequest
from dsinfer.chat.stream import ChoiceStream
from dsinfer.engine.outputs import CompletionOutput, RequestOutput
from dsinfer.sampling_params import SamplingParams

#: Offline chat samples greedily unless told otherwise, so the same question gets the same answer.
DEFAULT_CHAT_PARAMS = SamplingParams(max_tokens=512, temperature=0.0)
OFFLINE_MODEL_NAME = "offline"


@dataclass
class ChatCompletionOutput(CompletionOutput):
    """A completion parsed as a chat message: ``text`` is the answer, without the reasoning or tool calls."""

    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


def conversations_of(messages: list) -> list[list[dict[str, Any]]]:
    """One conversation (a list of messages) or a batch of them, as vLLM's ``LLM.chat`` accepts."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of messages (or of conversations)")
    return [messages] if isinstance(messages[0], dict) else list(messages)


def prepare_chat(
    chat_format: ChatFormat,
    messages: list[dict[str, Any]],
    params: SamplingParams,
    tools: list[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any] | None,
) -> tuple[PreparedRequest, SamplingParams]:
    """The encoded prompt and the engine's sampling for one conversation (stop strings go to the parser)."""
    body: dict[str, Any] = {"model": OFFLINE_MODEL_NAME, "messages": messages}
    if tools:
        body["tools"] = tools
    if chat_template_kwargs:
        body["chat_template_kwargs"] = chat_template_kwargs
    if params.stop:
        body["stop"] = list(params.stop)
    prepared = chat_format.prepare("chat", json.loads(json.dumps(body)))
    if prepared.structured_output is not None and params.structured_output is not None:
        raise ValueError("structured_output: the tools' forced choice already constrains this conversation")
    structured = params.structured_output or prepared.structured_output
    return prepared, replace(params, stop=[], detokenize=False, structured_output=structured)


def parsed_output(chat_format: ChatFormat, prepared: PreparedRequest, output: RequestOutput) -> RequestOutput:
    """``output`` with each completion parsed as the server parses a chat completion."""
    completions = []
    for completion in output.outputs:
        generator = recipe.ChatCompletionRequest.chunk_generator(prepared.request, output.request_id,
                                                                 OFFLINE_MODEL_NAME)  # fmt: skip
        stream = ChoiceStream(chat_format, prepared, generator)
        response = recipe.ChatCompletionResponse(output.request_id, OFFLINE_MODEL_NAME, 0, len(prepared.prompt_ids), 0)
        for event in stream.push(completion):
            response.accumulate(event)
        stream.close()
        choice = json.loads(response.to_json())["choices"][0]
        message = choice.get("message") or {}
        completions.append(ChatCompletionOutput(
            index=completion.index, text=message.get("content") or "", token_ids=completion.token_ids,
            finish_reason=choice.get("finish_reason") or completion.finish_reason, logprobs=completion.logprobs,
            top_logprobs=completion.top_logprobs, reasoning=message.get("reasoning_content"),
            tool_calls=message.get("tool_calls") or [],
        ))  # fmt: skip
    return replace(output, outputs=completions)
