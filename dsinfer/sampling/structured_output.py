"""Structured output: keep a completion inside a JSON schema, any JSON object, a regex or an EBNF grammar.

xgrammar does the work. :class:`StructuredOutputCompiler` is built once per engine from our tokenizer and
compiles each request's :class:`~dsinfer.sampling_params.StructuredOutput` into a token-level automaton,
keeping the most recent compilations in an LRU so repeated schemas cost nothing. Each sequence then owns a
:class:`GrammarConstraint`: before every step the sampler asks it to set the logits of the tokens the grammar
forbids to -inf (:meth:`GrammarConstraint.fill_mask`), and after every step the engine tells it which token
was chosen (:meth:`GrammarConstraint.accept`). When the grammar is complete only eos stays allowed, so a
constrained sequence ends by itself as soon as its text is whole.

Two choices shape the token mask:

* Added (control) tokens are never part of the grammar's text. DeepSeek's chat tokens (``<think>``,
  ``<｜User｜>``...) would otherwise be legal inside a JSON string, since their spelling is plain text, and the
  ones flagged special would vanish from the decoded output and leave invalid JSON behind. eos is the one
  exception: it is the grammar's stop token.
* JSON allows at most :data:`JSON_MAX_WHITESPACE` whitespace characters between two elements. Unbounded
  whitespace is legal JSON, but a model that starts emitting newlines inside a constrained object has
  nothing to stop it; the bound still leaves room for pretty-printed output.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
import xgrammar as xgr

from dsinfer.grammar import JSON_MAX_WHITESPACE, build_grammar
from dsinfer.sampling_params import StructuredOutput
from dsinfer.tokenizer import Tokenizer

DEFAULT_CACHE_SIZE = 128  # compiled grammars kept; one is a few MB at DeepSeek's 129,280-token vocabulary

# The DSML marker of DeepSeek's tool-call tags: the one control token a forced tool call's grammar may emit.
DSML_TOKEN = "\uff5cDSML\uff5c"


class GrammarViolation(ValueError):
    """A token the constraint did not allow was handed to :meth:`GrammarConstraint.accept`."""


def tokenizer_info(
    tokenizer: Tokenizer, vocab_size: int | None = None, keep_added: tuple[str, ...] = ()
) -> xgr.TokenizerInfo:
    """Describe our byte-level BPE vocabulary to xgrammar, with every added token except eos left out.

    The raw token strings are in GPT-2's byte-to-unicode spelling ("Ġ" for a space), which is what
    ``VocabType.BYTE_LEVEL`` decodes; DeepSeek's tokenizer prepends no space. An empty string marks a token
    that no grammar may produce. ``vocab_size`` is the model's (the logits' width): ids past the tokenizer's
    vocabulary are padding and are never allowed. ``keep_added`` names added tokens a grammar may produce
    after all (the DSML marker of tool-call tags, which the model was trained to write as one token); they
    are spelled in the byte-level alphabet so that xgrammar reads their text, and no other token may write
    their first byte (so the marker's text can only be the marker token).
    """
    if tokenizer.eos_id is None:
        raise ValueError("structured output needs a tokenizer with an eos token: it is how a grammar ends")
    vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    known = min(vocab_size, tokenizer.vocab_size)
    encoded_vocab = tokenizer.convert_ids_to_tokens(range(known)) + [""] * (vocab_size - known)
    if keep_added:
        # A kept marker must come out as its one token: the stream parser does not take the same text
        # spelled by ordinary tokens. Its lead byte (0xEF, U+F000..U+FFFF) is taken from every other token.
        lead_bytes = {_byte_level(content)[0] for content in keep_added}
        encoded_vocab = ["" if any(c in lead_bytes for c in token) else token for token in encoded_vocab]
    for content, token_id in tokenizer.special_tokens.items():
        if token_id < known:
            encoded_vocab[token_id] = _byte_level(content) if content in keep_added else ""
    return xgr.TokenizerInfo(
        encoded_vocab,
        xgr.VocabType.BYTE_LEVEL,
        vocab_size=vocab_size,
        stop_token_ids=[tokenizer.eos_id],
        add_prefix_space=False,
    )


def _byte_level(text: str) -> str:
    """``text`` in GPT-2's byte-to-unicode alphabet (how byte-level BPE vocabularies spell their tokens)."""
    alphabet = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for byte in range(256):
        if byte in alphabet:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return "".join(table[b] for b in text.encode("utf-8"))


def forced_tool_call_tag(
    tools: list[dict], variant: str, *, block_opened: bool, parallel_tool_calls: bool = True
) -> str:
    """The xgrammar structural tag (JSON text) of a forced DSML tool call: ``invoke`` blocks, then the close.

    ``tools`` are ``{"name", "parameters"}`` (JSON schemas). The layout is exactly the one deepseek-recipe
    renders and parses (one parameter per line, ``string="true"`` raw text for plain strings, JSON checked
    against the property's schema for everything else), with the schema's properties in their declared
    order, required ones always present. ``block_opened``: the prompt already ends with the opening
    ``<｜DSML｜tool_calls>`` line (chat mode, as the recipe renders a required tool choice); otherwise the
    grammar writes it (thinking mode, where the constraint starts after ``</think>``). V4.1 spells the tags
    with a leading space.
    """
    from xgrammar import structural_tag as st

    if not tools:
        raise ValueError("a forced tool call needs at least one tool")
    space = " " if variant == "v41" else ""
    calls = " calls" if variant == "v41" else "tool_calls"
    tags = [
        st.TagFormat(
            begin=f'<{DSML_TOKEN}{space}invoke name="{tool["name"]}">\n',
            content=_parameters_format(st, _object_schema(tool.get("parameters")), space),
            end=f"</{DSML_TOKEN}{space}invoke>\n",
        )
        for tool in tools
    ]
    elements: list = [] if block_opened else [st.ConstStringFormat(value=f"\n\n<{DSML_TOKEN}{calls}>\n")]
    elements.append(st.TagsWithSeparatorFormat(tags=tags, separator="", at_least_one=True,
                                               stop_after_first=not parallel_tool_calls))  # fmt: skip
    elements.append(st.ConstStringFormat(value=f"</{DSML_TOKEN}{calls}>"))
    return st.StructuralTag(format=st.SequenceFormat(elements=elements)).model_dump_json()


def _parameters_format(st, schema: dict, space: str):
    """One line per property, in declared order; optional properties may be left out."""
    required = set(schema.get("required") or [])
    elements = []
    for name, subschema in (schema.get("properties") or {}).items():
        subschema = subschema if isinstance(subschema, dict) else {}
        raw = _is_plain_string(subschema)
        begin = f'<{DSML_TOKEN}{space}parameter name="{name}" string="{"true" if raw else "false"}">'
        if raw:
            content = st.AnyTextFormat()
        elif _is_string_enum(subschema):
            begin = begin.replace('string="false"', 'string="true"')
            content = st.OrFormat(elements=[st.ConstStringFormat(value=v) for v in subschema["enum"]])
        else:
            content = st.JSONSchemaFormat(json_schema=subschema, max_whitespace_cnt=JSON_MAX_WHITESPACE)
        element = st.TagFormat(begin=begin, content=content, end=f"</{DSML_TOKEN}{space}parameter>\n")
        elements.append(element if name in required else st.OptionalFormat(content=element))
    if not elements:
        return st.ConstStringFormat(value="")
    return elements[0] if len(elements) == 1 else st.SequenceFormat(elements=elements)


def _is_plain_string(schema: dict) -> bool:
    """A string the model writes raw (``string="true"``): no constraint a raw text could break."""
    constrained = ("enum", "const", "pattern", "format", "minLength", "maxLength", "anyOf", "oneOf", "allOf")
    return schema.get("type") == "string" and not any(key in schema for key in constrained)


def _is_string_enum(schema: dict) -> bool:
    values = schema.get("enum")
    return isinstance(values, list) and bool(values) and all(isinstance(v, str) and v for v in values)


def _object_schema(parameters) -> dict:
    """A tool's parameters schema; tools without one take an empty object (no arguments)."""
    if not parameters:
        return {"type": "object", "properties": {}}
    return parameters


class StructuredOutputCompiler:
    """Compiles structured-output specs for one tokenizer and hands out per-sequence constraints.

    Build one per engine (building the tokenizer info takes ~0.3 s at 129k tokens). ``compile`` is
    thread-safe, so the engine may compile in a worker thread while steps run.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int | None = None,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        compile_threads: int = 8,
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size)
        self.vocab_size = self.tokenizer_info.vocab_size
        self.eos_token_id: int = tokenizer.eos_id  # type: ignore[assignment]  # checked by tokenizer_info
        # xgrammar's own cache never evicts; ours below is bounded.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=compile_threads, cache_enabled=False)
        self._vocab_size_asked = vocab_size
        self._tokenizer = tokenizer
        self._tool_compiler: xgr.GrammarCompiler | None = None  # built on the first forced tool call
        self._compile_threads = compile_threads
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, structured_output: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar for a spec, from the LRU when the same (kind, spec) was compiled recently."""
        key = structured_output.cache_key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        # Compile outside the lock: other specs need not wait. Two racing compiles of one key are harmless.
        compiled = self._compiler_for(key[0]).compile_grammar(build_grammar(*key))
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compiler_for(self, kind: str) -> xgr.GrammarCompiler:
        """Structural tags (forced tool calls) may emit the DSML token; every other grammar stays plain text."""
        if kind != "structural_tag":
            return self._compiler
        with self._lock:
            if self._tool_compiler is None:
                info = tokenizer_info(self._tokenizer, self._vocab_size_asked, keep_added=(DSML_TOKEN,))
                self._tool_compiler = xgr.GrammarCompiler(info, max_threads=self._compile_threads, cache_enabled=False)
            return self._tool_compiler

    def cached_keys(self) -> list[tuple[str, str]]:
        """The (kind, spec) keys in the LRU, least recently used first."""
        with self._lock:
            return list(self._cache)

    def make_constraint(
        self, structured_output: StructuredOutput, start_after_token: int | None = None
    ) -> GrammarConstraint:
        """A fresh constraint for one sequence (each of a request's ``n`` sequences needs its own)."""
        return GrammarConstraint(self.compile(structured_output), start_after_token=start_after_token)


class GrammarConstraint:
    """One sequence's position in its grammar: masks the next token's logits, advances on each token.

    With ``start_after_token`` set (``</think>`` for a thinking model) the sequence is free until that token
    has been accepted, and constrained from the next token on. Not thread-safe; not picklable.
    """

    def __init__(self, compiled_grammar: xgr.CompiledGrammar, *, start_after_token: int | None = None) -> None:
        self._matcher = xgr.GrammarMatcher(compiled_grammar)
        info = compiled_grammar.tokenizer_info
        self.vocab_size: int = info.vocab_size
        self.stop_token_ids: tuple[int, ...] = tuple(info.stop_token_ids)
        self.start_after_token = start_after_token
        self._active = start_after_token is None
        self._free_tokens = 0  # tokens accepted before the constraint became active, the start token included
        self._matched_tokens = 0  # tokens accepted by the matcher
        self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)

    @property
    def active(self) -> bool:
        """True once the constraint applies (at once without ``start_after_token``)."""
        return self._active

    def is_terminated(self) -> bool:
        """True once the grammar was completed and its stop token (eos) accepted: the sequence is done."""
        return self._active and self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """True when the text so far is a whole match, so eos is allowed now (the sequence may end here)."""
        return self._active and self._matcher.is_completed()

    def fill_mask(self, logits_row: torch.Tensor) -> None:
        """Set the logits of every token the grammar forbids next to -inf, in place; a no-op while inactive.

        ``logits_row`` is one float row of width ``vocab_size`` on any device. After termination only the
        stop tokens stay allowed (the engine should have finished the sequence already).
        """
        if not self._active:
            return
        if logits_row.shape != (self.vocab_size,):
            raise ValueError(f"logits row must have shape ({self.vocab_size},), got {tuple(logits_row.shape)}")
        if self._matcher.is_terminated():
            keep = logits_row[list(self.stop_token_ids)].clone()
            logits_row.fill_(float("-inf"))
            logits_row[list(self.stop_token_ids)] = keep
            return
        if self._matcher.fill_next_token_bitmask(self._bitmask):  # False: every token allowed
            apply_token_bitmask(logits_row, self._bitmask[0])

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> bool:
        """Write the next token's allowed set into row ``index`` of a CPU int32 bitmask (xgrammar's layout).

        Returns False when every token is allowed (the row is left as it was: callers start from all ones)
        and True otherwise; the batched form of :meth:`fill_mask`. Inactive: False. Terminated: stop tokens.
        """
        if not self._active:
            return False
        if self._matcher.is_terminated():
            bitmask[index].zero_()
            for token_id in self.stop_token_ids:
                bit = 1 << (token_id % 32)
                bitmask[index, token_id // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 bits
            return True
        return self._matcher.fill_next_token_bitmask(bitmask, index)

    def accept(self, token_id: int) -> None:
        """Advance past the token just appended to the sequence; GrammarViolation if it was not allowed.

        A rejected token leaves the state unchanged. Call exactly once per generated token, in order.
        """
        if not self._active:
            self._free_tokens += 1
            self._active = token_id == self.start_after_token
            return
        if not self._matcher.accept_token(token_id):
            state = "has terminated" if self._matcher.is_terminated() else "does not allow it here"
            raise GrammarViolation(f"token {token_id} rejected: the structured-output grammar {state}")
        self._matched_tokens += 1

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens (e.g. rejected speculative tokens)."""
        if not 0 <= num_tokens <= self._free_tokens + self._matched_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens; {self._free_tokens + self._matched_tokens} seen")
        matched = min(num_tokens, self._matched_tokens)
        if matched:
            self._matcher.rollback(matched)
            self._matched_tokens -= matched
        free = num_tokens - matched
        if free:
            self._free_tokens -= free
            self._active = False  # the start token was the last free token, and it is gone


# Row b holds, for the 8 tokens whose bits are byte value b, 0.0 (allowed) or -inf (forbidden).
_BYTE_PENALTIES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def apply_token_bitmask(logits_row: torch.Tensor, bitmask_row: torch.Tensor) -> None:
    """Set ``logits_row[i] = -inf`` where bit ``i`` of xgrammar's packed int32 bitmask is 0; any device.

    The bitmask is read as bytes (little-endian: token ``i`` is bit ``i % 8`` of byte ``i // 8``) and each
    byte picks a row of eight 0 / -inf penalties that is added to the logits: one gather and one add, measured
    faster on CPU than a boolean ``masked_fill_`` and than xgrammar's own CPU kernel (docs/perf.md, history), and
    plain torch on every device. Adding 0.0 leaves an allowed logit exactly as it was.
    """
    key = (logits_row.device, logits_row.dtype)
    penalties = _BYTE_PENALTIES.get(key)
    if penalties is None:
        forbidden = (torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 0
        penalties = torch.zeros(256, 8).masked_fill_(forbidden, float("-inf")).to(*key)
        _BYTE_PENALTIES[key] = penalties
    byte_values = bitmask_row.contiguous().view(torch.uint8).to(logits_row.device, torch.int32)
    logits_row.add_(penalties.index_select(0, byte_values).view(-1)[: logits_row.shape[-1]])
