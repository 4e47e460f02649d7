"""Request and response bodies of the OpenAI-compatible API (pydantic). Unknown request fields are ignored.

Chat bodies are also handed whole to deepseek-recipe, which converts them; the models here check the fields
first so that a wrong type is answered with a message naming the field. Ranges are OpenAI's documented ones
(temperature 0..2, top_p 0..1, penalties -2..2, top_logprobs 0..20), so a value OpenAI refuses is a 400 here
too, and the OpenAPI schema generated from these models says so.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from dsinfer.chat.limits import MAX_STOP_SEQUENCES, SEED_RANGE
from dsinfer.sampling_params import MAX_LOGPROBS, SamplingParams


def _integral(value: Any) -> Any:
    """JSON Schema's integer: 2.0 is the integer 2 (a float with a fraction, a string or a boolean is not)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integer = Annotated[int, BeforeValidator(_integral)]


def integer(**bounds: int) -> Any:
    """An :data:`Integer` with bounds (``ge``, ``le``) that also show in the OpenAPI schema when optional."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]  # this order: bounds before the validator


class Lenient(BaseModel):
    """Unknown fields are ignored; known ones are typed strictly, as the OpenAPI schema says (a JSON string or
    boolean is not a number here: ``"n": true`` is a client bug, not n = 1)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class LibraryAPIFields(Lenient):
    """The fields of a Responses or Messages body that we read ourselves (deepseek-recipe reads the whole body);
    typed so a wrong type names the field. Each API adds its own length field."""

    model: str | None = None
    stream: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    # The library reads no seed from these APIs; vLLM's extension, read here so a seeded request samples the
    # same tokens on every route (the same seed through chat completions gives the same tool call).
    seed: integer(ge=SEED_RANGE[0], le=SEED_RANGE[1]) | None = None


class StreamOptions(Lenient):
    include_usage: bool = False


class FunctionCall(Lenient):
    name: str
    arguments: str = "{}"


class ToolCallIn(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _text_and_image_parts_only(cls, value):
        """Text parts, and image parts (deepseek-recipe reads them; a model without a vision tower refuses)."""
        if isinstance(value, list):
            for part in value:
                if part.get("type") == "image_url" and isinstance(part.get("image_url"), (dict, str)):
                    continue
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(
                        "only text ({'type': 'text', 'text': ...}) and image ({'type': 'image_url', 'image_url': "
                        "{'url': 'data:...'}}) content parts are supported"
                    )
        return value


class FunctionDefinition(Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(Lenient):
    type: Literal["function"] = "function"
    function: dict[str, str]


class JsonSchemaFormat(Lenient):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema")
        return self


#: The efforts deepseek-recipe accepts ("none" turns thinking off; minimal -> low, medium -> high).
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class SamplingFields(Lenient):
    """Fields shared by chat and text completions that map onto :class:`SamplingParams`."""

    model: str | None = None
    max_tokens: integer(ge=1) | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: integer(ge=-1) | None = None
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: Integer = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[Integer] | None = None
    seed: integer(ge=SEED_RANGE[0], le=SEED_RANGE[1]) | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: bool = False
    min_tokens: Integer = Field(default=0, ge=0)
    skip_special_tokens: bool = True

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, value):
        if value == "" or (isinstance(value, list) and "" in value):
            raise ValueError("stop strings must not be empty")
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop strings are allowed, got {len(value)}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _ids_not_negative(cls, value):
        if value and min(value) < 0:
            raise ValueError("token ids must be >= 0")
        return value

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, default_max_tokens: int) -> SamplingParams:
        """Build validated SamplingParams (``ValueError`` names the field on bad values)."""
        values: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens if max_tokens is not None else default_max_tokens,
            "min_tokens": self.min_tokens,
            "stop": self.stop or [],
            "stop_token_ids": self.stop_token_ids or [],
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
        }
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # fmt: skip
            if getattr(self, name) is not None:
                values[name] = getattr(self, name)
        return SamplingParams(**values)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs to be true")
        return value


class CompletionRequest(SamplingFields):
    prompt: str | list[Integer] | list[str] | list[list[Integer]]
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, value):
        if isinstance(value, list) and (not value or any(isinstance(p, list) and not p for p in value)):
            raise ValueError("prompt must not be empty (nor any prompt of a batch)")
        if isinstance(value, list) and any(isinstance(t, int) and t < 0 for p in value for t in _ids(p)):
            raise ValueError("token ids must be >= 0")
        return value


def _ids(item) -> list:
    return item if isinstance(item, list) else [item]


class TokenizeRequest(Lenient):
    """vLLM's /tokenize: a text prompt, or a chat with the fields that shape its prompt."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[Integer]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: Any = None):
    """OpenAI-style error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
