"""Structured-output specs parsed into xgrammar grammars: the one parser behind validation and compilation.

It sits below both ``sampling_params`` (which checks a request's spec with it) and the engine (which compiles the
same grammar against the tokenizer), so a spec that passes validation is exactly the one that gets compiled.
"""

from __future__ import annotations

import re

import xgrammar as xgr

JSON_MAX_WHITESPACE = 16

# xgrammar's errors start with "[12:34:56] /project/cpp/file.cc:123: " and sometimes a failed-check preamble.
_XGRAMMAR_ERROR_PREFIX = re.compile(r"^\s*\[[\d:.]+\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")
_SPEC_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex", "grammar": "grammar",
               "structural_tag": "structural tag"}  # fmt: skip


def build_grammar(kind: str, spec_text: str) -> xgr.Grammar:
    """Parse a spec into an xgrammar ``Grammar`` (no tokenizer needed); ValueError names what is wrong.

    Shared by validation (``StructuredOutput`` checks its spec with it) and compilation, so a spec that
    passes validation is exactly the one that gets compiled.
    """
    try:
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec_text, max_whitespace_cnt=JSON_MAX_WHITESPACE)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', max_whitespace_cnt=JSON_MAX_WHITESPACE)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec_text)
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(spec_text)
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec_text)
    except (RuntimeError, ValueError) as exc:
        message = _XGRAMMAR_ERROR_PREFIX.sub("", str(exc)).strip()
        raise ValueError(f"structured_output: invalid {_SPEC_NAMES[kind]}: {message}") from None
    raise ValueError(f"structured_output.kind {kind!r} is not supported")
