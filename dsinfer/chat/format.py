"""DeepSeek-V4 / V4.1 requests through deepseek-recipe: API bodies in, prompt ids and parsing options out.

DeepSeek's protocol library ``deepseek-recipe`` is the authority on the chat format: it converts Chat
Completions, Responses and Anthropic Messages bodies into a conversation, renders and encodes the prompt the
model was trained on (``DeepseekV4Encoding`` / ``DeepseekV41Encoding``), and knows how the output must be
parsed. This module is the glue around it; it adds only what the library leaves to the server:

* **Model names.** The library resolves a request's ``model`` to a model version (which encoding to use).
  The served name, whatever ``--served-model-name`` says, maps to the version the checkpoint's config
  implies: V4 checkpoints render as ``DeepSeek-V4-Pro``, V4.1 as ``DeepSeek-V4.1-Flash``.
* **Fields it does not read.** ``chat_template_kwargs`` ``thinking`` / ``enable_thinking`` (vLLM, SGLang)
  become the library's ``thinking`` field; OpenAI's ``developer`` role is the system role; ``n`` choices are
  run as ``n`` parsers over one conversion (the library converts only ``n = 1``).
* **Forced tool calls.** ``tool_choice`` "required" or a named function is enforced by a grammar (see
  :func:`dsinfer.sampling.structured_output.forced_tool_call_tag`). In chat mode the library's prompt opens the
  call block and the grammar continues it. Thinking mode, which the library refuses for a forced choice, is
  rendered as ``auto`` with only the allowed tools, and the grammar starts after ``</think>``.
* **Images** (V4.1 with a vision tower): the library renders one ``<｜deepseek_image｜>`` placeholder per
  image part; :class:`~dsinfer.chat.image_reader.ImageReader` reads the parts and each placeholder is widened
  into its image's span (:func:`~dsinfer.images.inputs.expand_placeholders`).
* **Output constraints** the library reports (JSON schema, JSON object, regex) become the engine's
  structured-output grammar, applied after ``</think>`` in thinking mode.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import deepseek_recipe as recipe

from dsinfer.chat.image_reader import ImageReader, ImageRejected
from dsinfer.chat.limits import LimitError
from dsinfer.images.inputs import ImageInput, expand_placeholders
from dsinfer.sampling_params import SamplingParams, StructuredOutput
from dsinfer.tokenizer import ASSISTANT_TOKEN, DSML_TOKEN, THINK_END_TOKEN, Tokenizer

__all__ = ["MODEL_VERSIONS", "ChatFormat", "PreparedRequest", "Protocol", "Variant", "encode_chat"]

Variant = Literal["v4", "v41"]
IMAGE_PLACEHOLDER = "<｜deepseek_image｜>"
Protocol = Literal["chat", "responses", "messages"]

#: The library's model version for each checkpoint family (the version picks the prompt encoding).
MODEL_VERSIONS: dict[str, recipe.ModelVersion] = {
    "v4": recipe.ModelVersion.DeepseekV4Pro,
    "v41": recipe.ModelVersion.DeepseekV41Flash,
}
_REQUESTS = {"chat": recipe.ChatCompletionRequest, "responses": recipe.ResponsesRequest,
             "messages": recipe.MessagesRequest}  # fmt: skip


@dataclass
class PreparedRequest:
    """One converted request: what the engine runs and what the output parser needs."""

    protocol: Protocol
    request: recipe.ConversationRequest
    prompt_ids: list[int]
    thinking: bool
    structured_output: StructuredOutput | None
    echo: recipe.ResponsesEcho | None = None  # Responses: the request settings its response objects report
    images: list[ImageInput] = field(default_factory=list)  # placed: each knows where its span starts

    @property
    def parsing_options(self) -> recipe.ParsingOptions:
        return self.request.parsing_options

    @property
    def inference_options(self) -> recipe.InferenceOptions:
        return self.request.inference_options

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.request.parsing_options.parse_tool_calls and self.request.conversation.tools)

    def sampling_params(
        self,
        default_max_tokens: int,
        *,
        temperature: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
    ) -> SamplingParams:
        """Engine sampling for a Responses or Messages request, from the library's inference options.

        A temperature the request gives is used as given (the library reports 1.0 in thinking mode), and so is
        a seed (the library reads none from Responses or Messages bodies); stop sequences are not the engine's
        business: the stream processor applies them to answer text only, and it decodes the token ids itself,
        so the engine keeps no text.
        """
        options = self.request.inference_options
        values: dict[str, Any] = {
            "max_tokens": options.max_tokens or default_max_tokens,
            "temperature": temperature if temperature is not None else options.temperature,
            "top_p": options.top_p,
            "seed": seed if seed is not None else options.seed,
            "logprobs": (options.top_logprobs or 0) if options.logprobs else None,
            "structured_output": self.structured_output,
            "detokenize": False,
        }
        if top_k is not None:
            values["top_k"] = top_k
        return SamplingParams(**{k: v for k, v in values.items() if v is not None})


class ChatFormat:
    """The library set up for one served model: its tokenizer, its encoding, its model-name table."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        variant: Variant,
        served_model_name: str,
        *,
        default_thinking: bool = False,
        image_reader: ImageReader | None = None,
    ) -> None:
        if variant not in MODEL_VERSIONS:
            raise ValueError(f"unknown chat format variant {variant!r}: expected 'v4' or 'v41'")
        self.tokenizer = tokenizer
        self.variant: Variant = variant
        self.served_model_name = served_model_name
        self.recipe_tokenizer = recipe.Tokenizer.from_str(tokenizer.to_json())
        encoding = recipe.DeepseekV41Encoding() if variant == "v41" else recipe.DeepseekV4Encoding()
        options = recipe.ConversionOptions(default_thinking_mode=default_thinking)
        if variant == "v41":  # the released V4.1 checkpoints read images at <｜deepseek_image｜> (id 129264)
            special = recipe.SpecialTokens(image=IMAGE_PLACEHOLDER)
            encoding, options = encoding.with_special_tokens(special), options.with_special_tokens(special)
        self.encoding = encoding.with_tokenizer(self.recipe_tokenizer)
        self.image_reader = image_reader
        self.image_token_id = tokenizer.token_to_id(IMAGE_PLACEHOLDER)
        self.options = options.with_model_versions_by_name({served_model_name: MODEL_VERSIONS[variant]})
        self.think_end_id = tokenizer.token_to_id(THINK_END_TOKEN)
        self.dsml_id = tokenizer.token_to_id(DSML_TOKEN)
        self.assistant_id = tokenizer.token_to_id(ASSISTANT_TOKEN)
        # Added (control) tokens the parser never sees: only </think> and the DSML marker carry meaning in
        # the output; the rest (<｜User｜>, <think>, bos, eos...) must not reach content or reasoning.
        self.control_ids = frozenset(tokenizer.special_tokens.values())

    # ------------------------------------------------------------------ requests
    def prepare(self, protocol: Protocol, body: dict[str, Any]) -> PreparedRequest:
        """Convert an API body (a parsed JSON object) and encode its prompt.

        Raises ``recipe.ConversionError`` (it carries an OpenAI-style body and a status) or ``ValueError``.
        """
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        body = self._adapt(protocol, body)
        forced = _forced_tool(protocol, body)
        try:
            request, echo = self._convert(protocol, body)
            thinking_forced = False
        except recipe.ConversionError:
            if forced is None:
                raise
            relaxed = _without_tool_choice(protocol, body, forced)
            if relaxed is None:
                raise
            try:
                request, echo = self._convert(protocol, relaxed)
            except recipe.ConversionError:
                request = None
            if request is None or not request.conversation.thinking_mode:
                self._convert(protocol, body)  # raise the library's own error for the request as sent
                raise
            thinking_forced = True
        conversation = request.conversation
        if forced == "required" and not conversation.tools:
            raise LimitError("tool_choice is 'required' but the request defines no tools", "tool_choice")
        if forced not in (None, "required") and forced not in {tool.name for tool in conversation.tools}:
            raise LimitError(f"tool_choice names the function {forced!r}, which is not among the request's tools",
                             "tool_choice")  # fmt: skip
        structured = self._structured_output(request, forced, thinking_forced, protocol, body)
        prompt_ids, images = self._with_images(conversation, self.encode(conversation))
        return PreparedRequest(protocol, request, prompt_ids, conversation.thinking_mode, structured, echo,
                               images)  # fmt: skip

    def _with_images(self, conversation: recipe.Conversation, prompt_ids: list[int]):
        """Read the conversation's images and widen their placeholders; text-only prompts pass unchanged."""
        sources = self.encoding.render_conversation(conversation).image_sources
        if not sources:
            return prompt_ids, []
        if self.image_reader is None or self.image_token_id is None:
            raise ImageRejected(f"{sources[0].path or 'image'}: this model does not read images (no vision tower)")
        images = self.image_reader.read(sources)
        return expand_placeholders(prompt_ids, images, self.image_token_id)

    def encode(self, conversation: recipe.Conversation) -> list[int]:
        """Prompt ids exactly as the library encodes them (control tokens only where the template put them)."""
        return list(self.encoding.encode(conversation))

    def render(self, conversation: recipe.Conversation) -> str:
        return self.encoding.render_conversation(conversation).prompt

    def without_generation_prompt(self, prompt_ids: list[int]) -> list[int]:
        """The prompt up to the last ``<｜Assistant｜>``: the conversation without the generation prompt.

        Request text is encoded without control tokens, so the last ``<｜Assistant｜>`` id is the template's.
        """
        for position in range(len(prompt_ids) - 1, -1, -1):
            if prompt_ids[position] == self.assistant_id:
                return prompt_ids[:position]
        return prompt_ids

    def _convert(self, protocol: Protocol, body: dict[str, Any]):
        request = _REQUESTS[protocol](body)
        echo = request.echo() if protocol == "responses" else None
        return request.convert(self.options), echo

    def _adapt(self, protocol: Protocol, body: dict[str, Any]) -> dict[str, Any]:
        """Our additions to the library's fields, as a copy of the body."""
        body = dict(body)
        if body.get("model") is None:
            body["model"] = self.served_model_name
        if protocol != "chat":
            return body
        body.pop("n", None)
        kwargs = body.get("chat_template_kwargs")
        if isinstance(kwargs, dict) and "thinking" not in body:
            for key in ("thinking", "enable_thinking"):
                if key in kwargs:
                    body["thinking"] = {"type": "enabled" if kwargs[key] else "disabled"}
                    break
        messages = body.get("messages")
        if isinstance(messages, list):
            body["messages"] = [
                {**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m for m in messages
            ]
        return body

    def _structured_output(
        self, request: recipe.ConversationRequest, forced: str | None, thinking_forced: bool, protocol: Protocol,
        body: dict[str, Any],
    ) -> StructuredOutput | None:  # fmt: skip
        """The engine's grammar for this request, or None (tool_choice "auto" stays free)."""
        conversation = request.conversation
        start_after = self.think_end_id if conversation.thinking_mode else None
        constraint = request.inference_options.output_constraint
        if thinking_forced or (constraint is not None and constraint.kind == "tool_call_required"):
            from dsinfer.sampling.structured_output import forced_tool_call_tag

            tools = [{"name": t.name, "parameters": t.parameters} for t in conversation.tools]
            if forced not in (None, "required"):
                tools = [t for t in tools if t["name"] == forced]
            parallel = forced == "required" and _parallel_tool_calls(protocol, body)
            tag = forced_tool_call_tag(tools, self.variant, block_opened=not thinking_forced,
                                       parallel_tool_calls=parallel)  # fmt: skip
            return StructuredOutput(kind="structural_tag", spec=tag, start_after_token=start_after)
        if constraint is None or constraint.kind == "tool_call":
            return None
        if constraint.kind == "json":
            if not constraint.schema:
                return StructuredOutput(kind="json_object", start_after_token=start_after)
            return StructuredOutput(kind="json_schema", spec=constraint.schema, start_after_token=start_after)
        if constraint.kind == "regex":
            return StructuredOutput(kind="regex", spec=constraint.schema, start_after_token=start_after)
        raise ValueError(f"output constraint {constraint.kind!r} is not supported")


def _forced_tool(protocol: Protocol, body: dict[str, Any]) -> str | None:
    """ "required", the forced function's name, or None (auto / none / absent)."""
    choice = body.get("tool_choice")
    if protocol == "messages":
        if isinstance(choice, dict) and choice.get("type") == "any":
            return "required"
        if isinstance(choice, dict) and choice.get("type") == "tool" and isinstance(choice.get("name"), str):
            return choice["name"]
        return None
    if choice == "required":
        return "required"
    if isinstance(choice, dict):
        if protocol == "chat":
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
        else:
            name = choice.get("name") if choice.get("type") == "function" else None
        return name if isinstance(name, str) else None
    return None


def _tool_name(protocol: Protocol, tool: Any) -> str | None:
    if not isinstance(tool, dict):
        return None
    if protocol == "chat":
        function = tool.get("function")
        return function.get("name") if isinstance(function, dict) else None
    return tool.get("name")


def _without_tool_choice(protocol: Protocol, body: dict[str, Any], forced: str) -> dict[str, Any] | None:
    """The body with tool_choice left to "auto" and, for a named function, only that tool; None if it is absent."""
    relaxed = copy.deepcopy(body)
    relaxed.pop("tool_choice", None)
    if forced != "required":
        tools = [t for t in relaxed.get("tools") or [] if _tool_name(protocol, t) == forced]
        if not tools:
            return None
        relaxed["tools"] = tools
    return relaxed


def _parallel_tool_calls(protocol: Protocol, body: dict[str, Any]) -> bool:
    if protocol == "messages":
        choice = body.get("tool_choice")
        return not (isinstance(choice, dict) and choice.get("disable_parallel_tool_use"))
    return body.get("parallel_tool_calls") is not False


def encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    *,
    variant: Variant,
    thinking: bool,
    reasoning_effort: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    response_format: dict[str, Any] | None = None,
) -> list[int]:
    """Prompt ids of a chat, as the server would run it (builds a :class:`ChatFormat` each call: for tests)."""
    body: dict[str, Any] = {"messages": messages, "thinking": {"type": "enabled" if thinking else "disabled"}}
    if reasoning_effort is not None and thinking:
        body["reasoning_effort"] = reasoning_effort
    if tools:
        body["tools"] = tools
    if response_format is not None:
        body["response_format"] = response_format
    return ChatFormat(tokenizer, variant, "chat").prepare("chat", json.loads(json.dumps(body))).prompt_ids
