"""Tokenizer wrapper around the Hugging Face ``tokenizers`` library.

DeepSeek-V4 ships a byte-level BPE ``tokenizer.json`` (128000 BPE ids, then
1280 added tokens up to id 129279) and a ``tokenizer_config.json`` that names
the bos/eos/pad strings.  There is no chat template: prompts are rendered by a
separate encoder that concatenates control tokens and message text.  Because
message text comes from users, :meth:`Tokenizer.encode` can be told
(``allow_special=False``) to treat control-token spellings inside the text as
plain characters so that nobody can forge ``<｜User｜>`` and friends.

Real V4 layout (from the ``added_tokens`` of the DeepSeek-V4-Flash
``tokenizer.json``, see :data:`DEEPSEEK_V4_SPECIAL_TOKEN_IDS`):

* ids 0, 1, 2: ``<｜begin▁of▁sentence｜>``, ``<｜end▁of▁sentence｜>``, ``<｜▁pad▁｜>``
  (these three are also entries of the BPE vocabulary);
* ids 3..127999: BPE vocabulary;
* ids 128000..128798: ``<｜place▁holder▁no▁N｜>`` reserved slots;
* id 128799: ``<｜place▁holder▁no▁799｜>`` -- the DSpark noise token of V4-Flash
  (``dspark_noise_token_id`` = 128799); V4.1 renames this slot ``<｜System｜>``;
* ids 128800..128846: the named control tokens (FIM, chat roles, legacy tool
  calls, ``<think>``/``</think>``, ``｜DSML｜``, quick-instruction tasks...);
* ids 128847..129261: ``<|place_holder_mm_span_NNNN|>`` reserved slots;
* ids 129262..129279: image / table / grounding tokens.

Only some added tokens are flagged ``special`` (and so dropped by
``decode(..., skip_special_tokens=True)``): bos/eos/pad, the reserved slots,
``<｜end_of_query｜>`` and the image/grounding markers.  The chat-structure
tokens (``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``, ``</think>``,
``｜DSML｜``, ...) are NOT special in the real tokenizer: they survive
``skip_special_tokens=True``.  :data:`DEEPSEEK_V4_SKIPPED_TOKENS` lists which of
:data:`DEEPSEEK_V4_SPECIAL_TOKENS` are flagged special.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tokenizers

__all__ = [
    "ASSISTANT_TOKEN",
    "BOS_TOKEN",
    "DEEPSEEK_V41_SPECIAL_TOKEN_IDS",
    "DEEPSEEK_V4_SKIPPED_TOKENS",
    "DEEPSEEK_V4_SPECIAL_TOKENS",
    "DEEPSEEK_V4_SPECIAL_TOKEN_IDS",
    "DSML_TOKEN",
    "DSPARK_NOISE_TOKEN",
    "EOS_TOKEN",
    "LATEST_REMINDER_TOKEN",
    "PAD_TOKEN",
    "SYSTEM_TOKEN",
    "THINK_END_TOKEN",
    "THINK_START_TOKEN",
    "TOKENIZER_CONFIG_FILE",
    "TOKENIZER_FILE",
    "Tokenizer",
    "TokenizerLoadError",
    "USER_TOKEN",
]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SYSTEM_TOKEN = "<｜System｜>"  # V4.1 only (id 128799 there)
LATEST_REMINDER_TOKEN = "<｜latest_reminder｜>"
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"
DSML_TOKEN = "｜DSML｜"
# V4-Flash config: dspark_noise_token_id = 128799, which is this reserved slot.
DSPARK_NOISE_TOKEN = "<｜place▁holder▁no▁799｜>"

# (content, id in DeepSeek-V4-Flash tokenizer.json, flagged special there).
# Entries marked "V4.1" are not in the V4-Flash tokenizer: DeepSeek-V4.1 reuses
# the id of the entry just before them for a new spelling.  Their special flag
# is not published; they mirror their closest V4 siblings.
_V4_NAMED_TOKENS: tuple[tuple[str, int, bool], ...] = (
    (BOS_TOKEN, 0, True),
    (EOS_TOKEN, 1, True),
    (PAD_TOKEN, 2, True),
    (DSPARK_NOISE_TOKEN, 128799, True),
    (SYSTEM_TOKEN, 128799, False),  # V4.1
    ("<｜fim▁hole｜>", 128800, False),
    ("<｜fim▁begin｜>", 128801, False),
    ("<｜fim▁end｜>", 128802, False),
    (USER_TOKEN, 128803, False),
    (ASSISTANT_TOKEN, 128804, False),
    ("<|EOT|>", 128805, False),
    ("<｜tool▁calls▁begin｜>", 128806, False),
    ("<｜tool▁calls▁end｜>", 128807, False),
    ("<｜tool▁call▁begin｜>", 128808, False),
    ("<｜tool▁call▁end｜>", 128809, False),
    ("<｜tool▁outputs▁begin｜>", 128810, False),
    ("<｜tool▁outputs▁end｜>", 128811, False),
    ("<｜tool▁output▁begin｜>", 128812, False),
    ("<｜tool▁output▁end｜>", 128813, False),
    ("<｜tool▁sep｜>", 128814, False),
    ("<｜begin▁of▁repo▁name｜>", 128815, False),
    ("<｜end▁of▁repo▁name｜>", 128816, False),
    ("<｜begin▁of▁file▁name｜>", 128817, False),
    ("<｜end▁of▁file▁name｜>", 128818, False),
    ("<｜begin▁of▁file｜>", 128819, False),
    ("<｜end▁of▁file｜>", 128820, False),
    (THINK_START_TOKEN, 128821, False),
    (THINK_END_TOKEN, 128822, False),
    ("<｜place▁holder▁for▁copy｜>", 128823, False),
    ("<｜place▁holder▁for▁pointer▁replace｜>", 128824, False),
    (DSML_TOKEN, 128825, False),
    ("<｜begin▁sys｜>", 128826, False),
    ("<｜end▁sys｜>", 128827, False),
    (LATEST_REMINDER_TOKEN, 128828, False),
    ("<｜action｜>", 128829, False),
    ("<｜query｜>", 128830, False),
    ("<｜authority｜>", 128831, False),
    ("<｜domain｜>", 128832, False),
    ("<｜task｜>", 128833, False),
    ("<｜political｜>", 128834, False),
    ("<｜entity｜>", 128835, False),
    ("<｜title｜>", 128836, False),
    ("<｜safety｜>", 128837, False),
    ("<｜answer｜>", 128838, False),
    ("<｜search｜>", 128839, False),
    ("<dsml:", 128840, False),
    ("</dsml:", 128841, False),
    ("<｜search▁begin｜>", 128842, False),
    ("<｜search▁end｜>", 128843, False),
    ("<｜extracted_url｜>", 128844, False),
    ("<｜read_url｜>", 128845, False),
    ("<｜end_of_query｜>", 128846, True),
    ("<｜rl_image_pad｜>", 129262, True),
    ("<｜rl_image_start｜>", 129263, True),
    ("<｜image2｜>", 129264, False),
    ("<｜deepseek_image｜>", 129264, False),  # V4.1
    ("<｜/table>｜", 129265, False),  # sic: the real spelling
    ("<｜table｜>", 129266, False),
    ("<｜/td｜>", 129267, False),
    ("<｜td｜>", 129268, False),
    ("<｜/tr｜>", 129269, False),
    ("<｜tr｜>", 129270, False),
    ("<｜/polygon｜>", 129271, True),
    ("<｜polygon｜>", 129272, True),
    ("<｜/point｜>", 129273, True),
    ("<｜point｜>", 129274, True),
    ("<｜/box｜>", 129275, True),
    ("<｜box｜>", 129276, True),
    ("<｜/ref｜>", 129277, True),
    ("<｜ref｜>", 129278, True),
    ("<｜image｜>", 129279, True),
)

_V41_ONLY = frozenset({SYSTEM_TOKEN, "<｜deepseek_image｜>"})
_NOT_IN_V41 = frozenset(
    {
        DSPARK_NOISE_TOKEN,
        "<｜image2｜>",
        "<｜/table>｜",
        "<｜table｜>",
        "<｜/td｜>",
        "<｜td｜>",
        "<｜/tr｜>",
        "<｜tr｜>",
    }
)

#: Every named DeepSeek-V4 / V4.1 control token (reserved placeholder slots left
#: out, except the DSpark noise slot), ordered by real id.
DEEPSEEK_V4_SPECIAL_TOKENS: list[str] = [content for content, _, _ in _V4_NAMED_TOKENS]

#: The subset of :data:`DEEPSEEK_V4_SPECIAL_TOKENS` flagged ``special`` in the real
#: tokenizer, i.e. dropped by ``decode(..., skip_special_tokens=True)``.
DEEPSEEK_V4_SKIPPED_TOKENS: frozenset[str] = frozenset(c for c, _, special in _V4_NAMED_TOKENS if special)

#: Real ids in the DeepSeek-V4-Flash ``tokenizer.json``.
DEEPSEEK_V4_SPECIAL_TOKEN_IDS: dict[str, int] = {c: i for c, i, _ in _V4_NAMED_TOKENS if c not in _V41_ONLY}

#: Real ids in the DeepSeek-V4.1-Flash ``tokenizer.json`` (as reported by
#: third-party V4.1 ports; slot 128799 is ``<｜System｜>`` and 129264 is
#: ``<｜deepseek_image｜>``; the table tokens became reserved slots).
DEEPSEEK_V41_SPECIAL_TOKEN_IDS: dict[str, int] = {c: i for c, i, _ in _V4_NAMED_TOKENS if c not in _NOT_IN_V41}


class TokenizerLoadError(ValueError):
    """A tokenizer file is missing, unreadable or corrupt.  The message names the file."""


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return " ".join(text.split())


def _read_json(path: Path, what: str) -> Any:
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise TokenizerLoadError(f"{what} not found: {path}") from exc
    except OSError as exc:
        reason = exc.strerror or _one_line(exc)
        raise TokenizerLoadError(f"cannot read {what} {path}: {reason}") from exc
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise TokenizerLoadError(f"corrupt {what} {path}: not UTF-8 text ({exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise TokenizerLoadError(
            f"corrupt {what} {path}: invalid JSON at line {exc.lineno} column {exc.colno} ({exc.msg})"
        ) from exc


def _token_content(value: Any) -> str | None:
    """A token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TypeError(f"expected a token string or an object with 'content', got {value!r}")


class Tokenizer:
    """A loaded tokenizer: encode text to ids and decode ids to text.

    Build one with :meth:`from_dir`.  Thread-safe for concurrent encode/decode.

    Read once from the config at load (None where it names none): ``bos_token`` / ``eos_token`` / ``pad_token``
    and their ids ``bos_id`` / ``eos_id`` / ``pad_id``, and ``model_max_length``.
    """

    def __init__(
        self,
        tokenizer_json: Mapping[str, Any],
        config: Mapping[str, Any] | None = None,
        *,
        source: str = TOKENIZER_FILE,
        config_source: str = TOKENIZER_CONFIG_FILE,
    ) -> None:
        """Build from the parsed ``tokenizer.json`` and optional parsed ``tokenizer_config.json``.

        ``source``/``config_source`` are only used to name the files in error messages.
        """
        if not isinstance(tokenizer_json, Mapping) or "model" not in tokenizer_json:
            raise TokenizerLoadError(f"corrupt tokenizer file {source}: not a tokenizers JSON object")
        try:
            self._tok = tokenizers.Tokenizer.from_str(json.dumps(tokenizer_json))
            # Same pipeline without the added vocabulary: control-token spellings in
            # the text are then split like any other characters (allow_special=False).
            plain = dict(tokenizer_json)
            plain["added_tokens"] = []
            self._plain = tokenizers.Tokenizer.from_str(json.dumps(plain))
        except Exception as exc:  # tokenizers raises a bare Exception on bad input
            raise TokenizerLoadError(f"corrupt tokenizer file {source}: {_one_line(exc)}") from exc

        self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        self._special_tokens = {tok.content: i for i, tok in sorted(added.items())}
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)

        config = dict(config or {})
        self._config = config
        try:
            if config:
                bos = _token_content(config.get("bos_token"))
                eos = _token_content(config.get("eos_token"))
                pad = _token_content(config.get("pad_token"))
            else:
                # No config: fall back to DeepSeek's spellings when the vocab has them.
                bos = BOS_TOKEN if self._tok.token_to_id(BOS_TOKEN) is not None else None
                eos = EOS_TOKEN if self._tok.token_to_id(EOS_TOKEN) is not None else None
                pad = None
        except TypeError as exc:
            raise TokenizerLoadError(f"corrupt tokenizer config {config_source}: {exc}") from exc
        self.bos_token, self.eos_token, self.pad_token = bos, eos, pad
        self.bos_id = self._resolve(bos, "bos_token", config_source)
        self.eos_id = self._resolve(eos, "eos_token", config_source)
        self.pad_id = self._resolve(pad, "pad_token", config_source)
        max_len = config.get("model_max_length")
        self.model_max_length = int(max_len) if isinstance(max_len, int | float) else None

    def _resolve(self, token: str | None, field: str, config_source: str) -> int | None:
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerLoadError(
                f"corrupt tokenizer config {config_source}: {field} {token!r} is not in the vocabulary"
            )
        return token_id

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` (required) and ``tokenizer_config.json`` (optional) from ``path``.

        Raises :class:`TokenizerLoadError` (a ``ValueError``) naming the offending file.
        """
        directory = Path(path)
        return cls.from_file(directory / TOKENIZER_FILE, directory / TOKENIZER_CONFIG_FILE)

    @classmethod
    def from_file(cls, tokenizer_file: str | Path, config_file: str | Path | None = None) -> Tokenizer:
        """Load a ``tokenizer.json`` and, if it exists, a ``tokenizer_config.json``."""
        tokenizer_file = Path(tokenizer_file)
        data = _read_json(tokenizer_file, "tokenizer file")
        config: Any = None
        config_source = TOKENIZER_CONFIG_FILE
        if config_file is not None:
            config_file = Path(config_file)
            config_source = str(config_file)
            if config_file.exists():
                config = _read_json(config_file, "tokenizer config")
                if not isinstance(config, dict):
                    raise TokenizerLoadError(f"corrupt tokenizer config {config_file}: not a JSON object")
        return cls(data, config, source=str(tokenizer_file), config_source=config_source)

    # ------------------------------------------------------------ encode/decode
    def encode(self, text: str, add_special_tokens: bool = False, allow_special: bool = True) -> list[int]:
        """Token ids for ``text``.

        ``add_special_tokens`` runs the tokenizer.json post-processor, exactly as
        Hugging Face does; DeepSeek-V4's adds nothing (``add_bos_token`` is false),
        so prompt renderers put the bos token in themselves.

        With ``allow_special=False`` control-token spellings inside ``text`` (e.g. a
        user typing ``<｜User｜>``) are tokenized as ordinary characters: the result
        never contains an added-token id that the text itself spelled out.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        tok = self._tok if allow_special else self._plain
        return tok.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters in the vocabulary's longest token spelling (byte-level: its bytes), added tokens aside.

        A text of ``n`` characters is at least ``n / max_token_chars`` tokens: the server refuses a prompt that
        cannot fit the context without tokenizing it.
        """
        return max((len(token) for token in self._plain.get_vocab(with_added_tokens=False)), default=1)

    def to_json(self) -> str:
        """The ``tokenizer.json`` text of this tokenizer (for libraries that load their own copy)."""
        return self._tok.to_str()

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text for ``ids``.  ``skip_special_tokens`` drops tokens flagged special
        (bos/eos/pad, reserved slots...); DeepSeek's chat tokens such as
        ``<think>`` and ``<｜User｜>`` are not flagged and are kept."""
        id_list = self._check_ids(ids)
        return self._tok.decode(id_list, skip_special_tokens=skip_special_tokens)

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        if isinstance(ids, int):
            raise TypeError("expected a sequence of token ids, got a single int")
        id_list = [int(i) for i in ids]
        n = self._vocab_size
        for i in id_list:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is out of range for a vocabulary of {n}")
        return id_list

    # ------------------------------------------------------------ vocabulary
    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (BPE byte-level spelling or added token), or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string for an id, or None when the id is not in the vocabulary."""
        if not 0 <= token_id < self._vocab_size:
            return None
        return self._tok.id_to_token(token_id)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Raw token strings (byte-level spelling for BPE tokens) for ``ids``."""
        out = []
        for i in self._check_ids(ids):
            token = self._tok.id_to_token(i)
            if token is None:
                raise ValueError(f"token id {i} is not in the vocabulary")
            out.append(token)
        return out

    def convert_tokens_to_ids(self, tokens: Iterable[str]) -> list[int | None]:
        """Ids for token strings (None where unknown)."""
        return [self._tok.token_to_id(t) for t in tokens]

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (129280 for DeepSeek-V4)."""
        return self._vocab_size

    def __len__(self) -> int:
        return self._vocab_size

    @property
    def special_tokens(self) -> dict[str, int]:
        """Every added (control) token, string -> id, in id order.  Each encodes to
        exactly its one id when ``allow_special=True``."""
        return dict(self._special_tokens)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of added tokens flagged special: those ``skip_special_tokens`` drops."""
        return self._special_ids

    @property
    def config(self) -> dict[str, Any]:
        """A copy of the parsed tokenizer_config.json ({} when absent)."""
        return dict(self._config)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self._vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"
