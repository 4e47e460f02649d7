"""Speculative decoding settings (vLLM's ``--speculative-config`` spelling), parsed and validated at the edge.

``{"method": "mtp", "num_speculative_tokens": K}``: V4's MTP layer drafts K tokens per step (chained on its own
outputs past the first) and the target verifies them in the next forward. ``{"method": "dspark", ...}``: V4.1's
DSpark stages draft K tokens of one block (K at most the checkpoint's ``dspark_block_size``); the optional
``"confidence_threshold": t`` (0 to 1, default 0: verify all K) verifies only the leading drafts the confidence
head rates at least t (:mod:`dsinfer.speculative.dspark`). ``"draft_token_map": PATH`` (MTP; SGLang's
``--speculative-token-map``, FR-Spec's frequency-ranked drafting): a JSON array of the token ids the MTP layer may
draft, most often the most frequent ones of the traffic; each draft then reads only those rows of the head (a
quarter of its bytes at 32,768 of V4's 129,280 ids) instead of all of them. Verification stays exact: a token
outside the map is never drafted, so it is never accepted early, only produced by the target. Whether a
checkpoint can serve the method is checked against the model
(:func:`dsinfer.speculative.support.check_speculative_support`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dsinfer.config.json_object import json_object, require_object
from dsinfer.config.model import ConfigError

SPECULATIVE_METHODS = ("mtp", "dspark")
MAX_SPECULATIVE_TOKENS = 5
_REQUIRED_FIELDS = ("method", "num_speculative_tokens")
_KNOWN_FIELDS = (*_REQUIRED_FIELDS, "confidence_threshold", "draft_token_map")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Which drafter runs, how many tokens it proposes per step (1 to ``MAX_SPECULATIVE_TOKENS``), and (DSpark)
    the confidence below which drafts are not verified (0: verify every draft), and (MTP) the file of the token
    ids it may draft (None: every id)."""

    method: str
    num_speculative_tokens: int
    confidence_threshold: float = 0.0
    draft_token_map: str | None = None

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
        t = self.confidence_threshold
        if not isinstance(t, int | float) or isinstance(t, bool) or not 0 <= t <= 1:
            raise ConfigError(f"speculative_config 'confidence_threshold': expected a number from 0 to 1, got {t!r}")
        if t and self.method != "dspark":
            raise ConfigError(
                "speculative_config 'confidence_threshold': only 'dspark' drafts have a confidence head to cut them"
            )
        if self.draft_token_map is not None:
            if self.method != "mtp":
                raise ConfigError(
                    "speculative_config 'draft_token_map': only 'mtp' drafts read the head once a draft "
                    "(dspark drafts a block with one read)"
                )
            read_draft_token_map(self.draft_token_map)


def read_draft_token_map(path: str) -> list[int]:
    """The token ids of a ``draft_token_map`` file (a JSON array of distinct non-negative integers); raises
    :class:`ConfigError` naming the field and what is wrong. Whether each id is in the model's vocabulary is the
    drafter's check."""
    where = f"speculative_config 'draft_token_map' ({path})"
    if not isinstance(path, str) or not path:
        raise ConfigError(f"speculative_config 'draft_token_map': expected a file path, got {path!r}")
    try:
        ids = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(ids, list) or not ids:
        raise ConfigError(f"{where}: expected a non-empty JSON array of token ids")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{where}: every entry must be a non-negative integer token id")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{where}: token ids repeat")
    return ids


def parse_speculative_config(value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A JSON string or a dict (as vLLM takes them) into a :class:`SpeculativeConfig`; ``None`` stays off.

    Raises :class:`ConfigError` naming the field that is wrong (or saying the JSON is not valid)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        value = json_object(value, "speculative_config", ConfigError)
    value = require_object(value, "speculative_config", ConfigError)
    unknown = sorted(set(value) - set(_KNOWN_FIELDS))
    if unknown:
        raise ConfigError(f"speculative_config: unknown field {unknown[0]!r} (known: {', '.join(_KNOWN_FIELDS)})")
    for name in _REQUIRED_FIELDS:
        if name not in value:
            raise ConfigError(f"speculative_config {name!r}: missing")
    return SpeculativeConfig(
        value["method"],
        value["num_speculative_tokens"],
        value.get("confidence_threshold", 0.0),
        value.get("draft_token_map"),
    )
