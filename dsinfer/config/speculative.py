"""Speculative decoding settings (vLLM's ``--speculative-config`` spelling), parsed and validated at the edge.

``{"method": "mtp", "num_speculative_tokens": K}``: the checkpoint's MTP layer drafts K tokens per step (chained
on its own outputs past the first) and the target verifies them in the next forward. Whether a checkpoint can
serve the method is checked against the model (:func:`dsinfer.spec.support.check_speculative_support`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dsinfer.config.model import ConfigError

SPECULATIVE_METHODS = ("mtp", "dspark")
MAX_SPECULATIVE_TOKENS = 5
_KNOWN_FIELDS = ("method", "num_speculative_tokens")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which drafter runs and how many tokens it proposes per step (1 to ``MAX_SPECULATIVE_TOKENS``)."""

    method: str
    num_speculative_tokens: int

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"speculative_config 'method': expected one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"speculative_config 'num_speculative_tokens': expected an integer from 1 to "
                f"{MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )


def parse_speculative_config(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A JSON string or a dict (as vLLM takes them) into a :class:`SpeculativeConfig`; ``None`` stays off.

    Raises :class:`ConfigError` naming the field that is wrong (or saying the JSON is not valid)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"speculative_config: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"speculative_config: expected a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KNOWN_FIELDS))
    if unknown:
        raise ConfigError(f"speculative_config: unknown field {unknown[0]!r} (known: {', '.join(_KNOWN_FIELDS)})")
    for name in _KNOWN_FIELDS:
        if name not in value:
            raise ConfigError(f"speculative_config {name!r}: missing")
    return SpeculativeConfig(value["method"], value["num_speculative_tokens"])
