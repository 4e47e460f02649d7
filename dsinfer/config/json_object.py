"""One JSON object read from user input (a dataset line, a ``--speculative-config`` value), with the error every
reader gives: where it came from, then what is wrong."""

from __future__ import annotations

import json
from typing import Any


def json_object(text: str, where: str, error: type[Exception]) -> dict[str, Any]:
    """``text`` parsed as a JSON object; otherwise ``error`` naming ``where``: invalid JSON (its message and
    column) or a value that is no object (its type)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    return require_object(value, where, error)


def require_object(value: Any, where: str, error: type[Exception]) -> dict[str, Any]:
    """``value`` where it is a JSON object (a dict), else ``error`` naming ``where`` and the type it has."""
    if not isinstance(value, dict):
        raise error(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value
