"""vLLM's structured-output request fields, and the JSON schemas no grammar can honour.

vLLM clients constrain a completion with ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` (older releases) or ``structured_outputs: {"json" | "regex" | "choice" | "grammar": ...}``
(newer ones). They map onto the engine's xgrammar constraints exactly as ``response_format`` does, so a client
that sends them gets the constraint it asked for rather than silently unconstrained text. Two ways of
constraining one request (``response_format`` and a guided field, or two guided fields) are a 400 naming the
second one.

xgrammar accepts some schemas it cannot enforce (``allOf`` of several schemas is ignored with a warning) and
some no output can satisfy (``minLength`` beyond the context, ``minimum`` above ``maximum``); both are a 400
naming the field here, instead of a 200 whose text breaks the schema or never ends.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dsinfer.chat.limits import LimitError
from dsinfer.sampling_params import StructuredOutput

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_BOUNDS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"),
           ("minimum", "maximum"))  # fmt: skip


def guided_output(body: Any, start_after_token: int | None, max_model_len: int) -> StructuredOutput | None:
    """The constraint the body's vLLM fields ask for (None without them); a bad one is a :class:`LimitError`."""
    if not isinstance(body, dict):
        return None
    present = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    if not present:
        return None
    if len(present) > 1 or body.get("response_format") not in (None, {"type": "text"}):
        second = present[1] if len(present) > 1 else present[0]
        raise LimitError(f"{second}: give one structured-output constraint per request", second)
    field, value = present[0], body[present[0]]
    if field == "structured_outputs":
        if not isinstance(value, dict):
            raise LimitError('structured_outputs must be an object such as {"json": SCHEMA}', field)
        kinds = [kind for kind in STRUCTURED_OUTPUT_KINDS if value.get(kind) not in (None, False)]
        if len(kinds) != 1:
            raise LimitError(f"structured_outputs must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}",
                             field)  # fmt: skip
        kind, value, param = kinds[0], value[kinds[0]], f"structured_outputs.{kinds[0]}"
    else:
        kind, param = field.removeprefix("guided_"), field
    try:
        return _constraint(kind, value, start_after_token, param, max_model_len)
    except LimitError:
        raise
    except ValueError as exc:
        raise LimitError(f"{param}: {exc}", param) from None


def _constraint(kind: str, value: Any, start_after: int | None, param: str, max_model_len: int) -> StructuredOutput:
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        if not isinstance(schema, dict):
            raise ValueError("must be a JSON schema object")
        check_schema(schema, param, max_model_len)
        return StructuredOutput("json_schema", schema, start_after)
    if kind == "json_object":
        return StructuredOutput("json_object", None, start_after)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError("must be a non-empty list of non-empty strings")
        return StructuredOutput("regex", "(" + "|".join(re.escape(choice) for choice in value) + ")", start_after)
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    return StructuredOutput("regex" if kind == "regex" else "grammar", value, start_after)


def check_schema(schema: Any, param: str, max_model_len: int) -> None:
    """Refuse a JSON schema the grammar would not enforce or no completion could satisfy (400 naming ``param``)."""
    pending: list[tuple[Any, str]] = [(schema, param)]
    while pending:
        node, where = pending.pop()
        if isinstance(node, list):
            pending.extend((item, f"{where}.{index}") for index, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            raise LimitError(f"{where}: allOf with more than one schema cannot be enforced; merge them into one "
                             "schema", where)  # fmt: skip
        _check_bounds(node, where, max_model_len)
        pending.extend((child, f"{where}.{key}") for key, child in node.items() if isinstance(child, dict | list))


def _check_bounds(node: dict, where: str, max_model_len: int) -> None:
    for low_key, high_key in _BOUNDS:
        low, high = (_number(node.get(key)) for key in (low_key, high_key))  # a property may be named so
        if low is not None and high is not None and low > high:
            raise LimitError(f"{where}: {low_key} {low} is above {high_key} {high}: no value satisfies it", where)
        if low_key != "minimum" and low is not None and low >= max_model_len:
            raise LimitError(f"{where}: {low_key} {low} cannot fit in this model's context of {max_model_len} "
                             "tokens", where)  # fmt: skip


def _number(value: Any) -> int | float | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None
