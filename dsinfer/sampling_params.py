"""SamplingParams: how one request wants its tokens chosen and when it wants generation to stop.

The fields and their meaning follow the OpenAI API and vLLM, so the server can map a request body onto them
field by field. Every value is checked once, here, when the object is built: the engine and the sampler trust
what they are given, and a user gets one message naming the field instead of a crash deep in a step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

# Temperatures below this are treated as greedy, as vLLM does: dividing logits by a vanishing temperature
# only approaches argmax while risking overflow, so we take argmax directly.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
# OpenAI's documented range for presence_penalty and frequency_penalty.
OPENAI_PENALTY_RANGE = (-2.0, 2.0)

StructuredOutputKind = Literal["json_schema", "json_object", "regex", "grammar", "structural_tag"]


@dataclass
class StructuredOutput:
    """A constraint on the text of a completion: a JSON schema, any JSON object, a regex, an EBNF grammar or an
    xgrammar structural tag (forced DSML tool calls).

    ``spec`` is the JSON schema (a dict, or its JSON text) for ``json_schema``, the pattern for ``regex``, the
    EBNF text (GBNF dialect, root rule ``root``) for ``grammar``, the structural tag's JSON text for
    ``structural_tag``, and None for ``json_object``. The spec is
    parsed by xgrammar when the object is built, so a bad one is a ``ValueError`` naming the problem at the
    edge (the server's 400), never a failure inside an engine step.
    """

    kind: StructuredOutputKind
    spec: str | dict | None = None
    # The constraint applies only after this token has been generated (``</think>`` in thinking mode).
    start_after_token: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def spec_text(self) -> str:
        """The spec as one string: a dict schema as its JSON text (property order kept: it steers generation)."""
        if self.spec is None:
            return ""
        return self.spec if isinstance(self.spec, str) else json.dumps(self.spec, ensure_ascii=False)

    @property
    def cache_key(self) -> tuple[str, str]:
        """Identifies the compiled grammar: two requests with equal keys share one compilation."""
        return (self.kind, self.spec_text)

    def validate(self) -> None:
        """Raise ValueError naming what is wrong with ``kind`` or ``spec`` (xgrammar's own words for a bad spec)."""
        kinds = get_args(StructuredOutputKind)
        if self.kind not in kinds:
            raise ValueError(f"structured_output.kind must be one of {', '.join(kinds)}; got {self.kind!r}")
        if self.kind == "json_object":
            if self.spec is not None:
                raise ValueError("structured_output.spec must be None for kind 'json_object'")
        elif self.kind == "json_schema":
            self._validate_schema_shape()
        elif not isinstance(self.spec, str) or not self.spec:
            raise ValueError(f"structured_output.spec must be a non-empty string for kind {self.kind!r}")
        # xgrammar costs seconds to import; only requests that ask for structured output pay for it.
        from dsinfer.grammar import build_grammar

        build_grammar(self.kind, self.spec_text)

    def _validate_schema_shape(self) -> None:
        if isinstance(self.spec, str):
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_output.spec is not valid JSON: {exc}") from None
        elif isinstance(self.spec, dict):
            schema = self.spec
            try:
                json.dumps(schema)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"structured_output.spec is not JSON-serialisable: {exc}") from None
        else:
            raise ValueError(f"structured_output.spec must be a JSON schema (dict or JSON text), got {self.spec!r}")
        if not isinstance(schema, dict):
            raise ValueError(f"structured_output.spec must be a JSON schema object, got {schema!r}")


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters (OpenAI / vLLM semantics); validated on construction."""

    n: int = 1
    max_tokens: int | None = 16  # None: generate until the sequence reaches max_model_len
    min_tokens: int = 0
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # a single string is accepted and becomes a one-item list
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top logprobs to return per token, 0..20; 0: only the chosen token's
    skip_special_tokens: bool = True
    # False: the engine keeps no text for the completion (a caller that parses the token ids itself, as the chat
    # server does, saves the per-token detokenization); stop strings need the text, so they need True.
    detokenize: bool = True
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutput | None = None  # constrain the completion to a schema / regex / grammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        self.validate()
        # Integers are valid spellings of the float fields; store floats so later arithmetic is uniform.
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            setattr(self, name, float(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        """True when the request wants the argmax token at every step (temperature 0)."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Raise ValueError naming the first field whose value no request could sensibly mean."""
        _check_int("n", self.n, minimum=1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _check_int("top_k", self.top_k, minimum=-1)
        _check_number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        self._validate_penalties()
        if self.seed is not None:
            _check_int("seed", self.seed)
        self._validate_stops()
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS)
        for name in ("ignore_eos", "skip_special_tokens", "detokenize", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are matched in the text: they need detokenize=True")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError(f"structured_output must be a StructuredOutput or None, got {self.structured_output!r}")

    def _validate_penalties(self) -> None:
        low, high = OPENAI_PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {value!r}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")

    def _validate_stops(self) -> None:
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty, got ''")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0)


def _check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> None:
    """Ints only: bool is an int subclass in Python, but `top_k=True` is a client bug, not a request."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")


def _check_number(name: str, value: Any) -> None:
    """A finite int or float; rejects bools, strings and NaN/inf, which would poison every logit they touch."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
