"""Every ``DSINFER_*`` environment variable, declared once: its name, type, default and why it exists.

This module is the only place in the package that reads them (``tests/test_envs.py`` holds the rest of the
package to that), so a reader finds every knob in one list and every bad value fails the same way: one
``ValueError`` naming the variable, what it takes and what it got. Flags and config files remain the way to
configure a run; these variables are for measurement runs, deployment secrets and switches that kernels read.

A value is parsed at its first use and cached against the raw text it came from. Reading a variable costs one
lookup of the environment and a comparison, never a second parse, and a test that changes a variable (pytest's
``monkeypatch.setenv``) sees the new value at the next read without clearing anything.

This module imports nothing from ``dsinfer``: everything may import it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["ALL", "EnvVar", "describe"]

Value = TypeVar("Value")


@dataclass(frozen=True)
class EnvVar(Generic[Value]):
    """One environment variable: ``name``; ``takes`` says in words what it accepts (the error message quotes it);
    ``parse`` turns its stripped, non-empty text into a value or raises ``ValueError``; ``default`` is the value
    when it is unset or empty (None where the code that reads it keeps a measured constant of its own);
    ``why`` is one line on what it is for."""

    name: str
    takes: str
    parse: Callable[[str], Value]
    default: Value | None
    why: str

    def get(self) -> Value | None:
        """The variable's value: its parsed text when set, else :attr:`default`."""
        raw = os.environ.get(self.name)
        cached = _CACHE.get(self.name)
        if cached is not None and cached[0] == raw:
            return cached[1]
        value = self._parse(raw)
        _CACHE[self.name] = (raw, value)
        return value

    def _parse(self, raw: str | None) -> Value | None:
        text = (raw or "").strip()
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError:
            raise ValueError(f"{self.name} must be {self.takes}, got {text!r}") from None


_CACHE: dict[str, tuple[str | None, Any]] = {}


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(text)
    return text == "1"


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise ValueError(text)
    return int(text)


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value == 0:
        raise ValueError(text)
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise ValueError(text)
    return value


def _text(text: str) -> str:
    return text


def _one_of(*choices: str, dash_is_underscore: bool = False) -> Callable[[str], str]:
    """A parser accepting ``choices`` in any case (and ``-`` for ``_`` where asked)."""

    def parse(text: str) -> str:
        value = text.lower().replace("-", "_") if dash_is_underscore else text.lower()
        if value not in choices:
            raise ValueError(text)
        return value

    return parse


def _warps(text: str) -> int:
    if text not in ("1", "2", "4", "8", "16"):
        raise ValueError(text)
    return int(text)


def _op_choices(text: str) -> tuple[tuple[str, str], ...]:
    """``op=backend`` pairs separated by commas, in the order given."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        op, sep, backend = item.partition("=")
        if not sep or not op.strip() or not backend.strip():
            raise ValueError(item)
        pairs.append((op.strip(), backend.strip()))
    return tuple(pairs)


def _choices(*choices: str) -> str:
    return "one of " + ", ".join(choices)


# --- op backends and kernels -----------------------------------------------------------------------------------

OPS = EnvVar(
    "DSINFER_OPS", "comma-separated op=backend pairs", _op_choices, (),
    "force ops' backends (e.g. routed_moe=reference) instead of the best that serves the device",
)  # fmt: skip
PDL = EnvVar(
    "DSINFER_PDL", "0 or 1", _flag, True,
    "launch kernels as programmatic dependents on sm_90+ (0: off, to measure what it gains)",
)  # fmt: skip
OVERLAP = EnvVar(
    "DSINFER_OVERLAP", "0 or 1", _flag, True,
    "run a small step's independent chains (shared expert / routed experts) on two CUDA streams",
)  # fmt: skip
OVERLAP_MAX_TOKENS = EnvVar(
    "DSINFER_OVERLAP_MAX_TOKENS", "a non-negative integer", _non_negative_int, 256,
    "the largest step that overlaps its chains; larger steps fill the GPU on their own",
)  # fmt: skip
CODED_ATTENTION_DECODE = EnvVar(
    "DSINFER_CODED_ATTENTION_DECODE", _choices("once", "twice"), _one_of("once", "twice"), None,
    "how the coded-cache attention kernel decodes a tile (unset: the measured form of ops/coded_attention)",
)  # fmt: skip
MOE_GEMV_MAX_TOKENS = EnvVar(
    "DSINFER_MOE_GEMV_MAX_TOKENS", "a non-negative integer", _non_negative_int, 8,
    "the largest step whose FP4 routed experts take the decode GEMV (0: never)",
)  # fmt: skip
MOE_DOWN_SPLITS = EnvVar(
    "DSINFER_MOE_DOWN_SPLITS", "a positive integer", _positive_int, None,
    "splits of a token's slots in every MoE down GEMV launch (measurement runs; unset: the configured ones)",
)  # fmt: skip
FP8_KERNEL_MAX_TOKENS = EnvVar(
    "DSINFER_FP8_KERNEL_MAX_TOKENS", "a non-negative integer", _non_negative_int, None,
    "the largest step an FP8 linear runs in the code-reading kernel (0: never; unset: the measured limit)",
)  # fmt: skip
FP8_GEMV_MAX_WEIGHT = EnvVar(
    "DSINFER_FP8_GEMV_MAX_WEIGHT", "a non-negative integer", _non_negative_int, None,
    "the largest weight (elements) the one-token FP8 GEMV takes (0: never; unset: the measured limit)",
)  # fmt: skip
STORE_WARPS = EnvVar(
    "DSINFER_STORE_WARPS", "a power of two from 1 to 16", _warps, None,
    "warps of a cache-store program (measurement runs; unset: chosen by row width)",
)  # fmt: skip

# --- weights and Engram tables ---------------------------------------------------------------------------------

FP8_LINEARS = EnvVar(
    "DSINFER_FP8_LINEARS", _choices("keep", "dequantize"), _one_of("keep", "dequantize"), None,
    "keep FP8 linear weights as codes or dequantize them at load (unset: the device's default)",
)  # fmt: skip
ENGRAM_PLACEMENT = EnvVar(
    "DSINFER_ENGRAM_PLACEMENT", _choices("device", "host", "sharded"), _one_of("device", "host", "sharded"), None,
    "where the Engram tables live when --engram-placement is not given (unset: chosen by size)",
)  # fmt: skip
ENGRAM_DEVICE_BUDGET_GIB = EnvVar(
    "DSINFER_ENGRAM_DEVICE_BUDGET_GIB", "a number of GiB", _non_negative_float, None,
    "the most GPU memory Engram tables may take before they stay on the host (unset: a quarter of the GPU)",
)  # fmt: skip
ENGRAM_HOST_METHOD = EnvVar(
    "DSINFER_ENGRAM_HOST_METHOD", _choices("zero_copy", "staged", "split"),
    _one_of("zero_copy", "staged", "split", dash_is_underscore=True), None,
    "how host-placed Engram rows reach the GPU (unset: zero_copy)",
)  # fmt: skip
ENGRAM_SEGMENT = EnvVar(
    "DSINFER_ENGRAM_SEGMENT", "a segment name", _text, None,
    "the shared-memory segment name of the Engram tables (two jobs on one host: tell them apart)",
)  # fmt: skip
ENGRAM_ATTACH_TIMEOUT = EnvVar(
    "DSINFER_ENGRAM_ATTACH_TIMEOUT", "a number of seconds", _non_negative_float, 1800.0,
    "how long a rank waits for another to finish loading the Engram segment",
)  # fmt: skip
HUGETLBFS = EnvVar(
    "DSINFER_HUGETLBFS", "a directory", _text, None,
    "the hugetlbfs mount of huge-page Engram segments (unset: the first 2 MiB mount in /proc/mounts)",
)  # fmt: skip

# --- processes and services ------------------------------------------------------------------------------------

RANK_AUTHKEY = EnvVar(
    "DSINFER_RANK_AUTHKEY", "a shared secret", _text, None,
    "the secret the ranks of several hosts authenticate their connections with (required for --nnodes > 1)",
)  # fmt: skip
JUDGE_BASE_URL = EnvVar(
    "DSINFER_JUDGE_BASE_URL", "a URL", _text, None,
    "the OpenAI-compatible endpoint 'dsinfer eval grade' asks when --judge-base-url is not given",
)  # fmt: skip
JUDGE_MODEL = EnvVar(
    "DSINFER_JUDGE_MODEL", "a model name", _text, None,
    "the judge model when --judge-model is not given (unset: the endpoint's only model)",
)  # fmt: skip
JUDGE_API_KEY = EnvVar(
    "DSINFER_JUDGE_API_KEY", "an API key", _text, None,
    "the judge endpoint's key when --judge-api-key is not given (unset: $OPENAI_API_KEY)",
)  # fmt: skip

ALL: tuple[EnvVar, ...] = tuple(value for value in dict(globals()).values() if isinstance(value, EnvVar))
"""Every declared variable, in the order above."""


def describe() -> str:
    """One line per variable: name, what it takes, default, why (for ``--help`` texts and the docs)."""
    return "\n".join(f"{v.name} ({v.takes}; default {v.default!r}): {v.why}" for v in ALL)
