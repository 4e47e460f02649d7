"""The Engram compressed vocabulary: token id -> compressed id.

DeepSeek-V4.1 hashes n-grams of *compressed* ids, not of token ids: tokens whose text
normalises alike (``" The"``, ``"the"``, ``"THE"``, ``"thé"``) share one id, so the n-gram
tables see case, accent and leading-space variants as the same word.  The map is not
stored in the checkpoint; it is rebuilt from the tokenizer, and it must come out exactly
as in training: every hash multiplier was drawn against its size
(``engram_compressed_vocab_size``, 99,092 for the released tokenizer), so a map that
differed in a single id would address the wrong table rows without any error.

The rule (Hugging Face ``build_compressed_token_map`` in ``modeling_deepseek_v41.py``):

1. decode each id on its own, special tokens kept;
2. a text containing U+FFFD (a partial UTF-8 byte token) is keyed by its raw token
   string (``id_to_token``) instead of its text;
3. any other text is normalised with the ``tokenizers`` pipeline below (NFKC, NFD,
   strip combining marks, lowercase, runs of space/tab/CR/LF -> one space, strip);
   a text that is whitespace only becomes a single space (a sentinel carries it
   through the strip); a text that normalises to nothing keys by its raw text;
4. equal keys share a compressed id; ids are handed out in first-seen (token id) order.

The normalisation runs through the ``tokenizers`` normalizers, the same Rust code the
reference uses: Python's ``unicodedata`` / ``str.lower`` differ from it on a few
characters and would silently move tokens between ids.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import tokenizers
import torch
from tokenizers import Regex, normalizers

__all__ = [
    "REPLACEMENT_CHARACTER",
    "TokenizerLike",
    "build_compressed_vocabulary",
    "compressed_key",
    "engram_normalizer",
]

REPLACEMENT_CHARACTER = "\ufffd"
# A private-use character: a text that is exactly one space is swapped for it before
# the strip and back after, so it keeps a key of its own instead of becoming empty.
_LONE_SPACE_SENTINEL = "\ue000"


class TokenizerLike(Protocol):
    """What :func:`build_compressed_vocabulary` needs from a tokenizer.

    :class:`dsinfer.tokenizer.Tokenizer` has this shape.  A ``tokenizers.Tokenizer`` or a
    Hugging Face fast tokenizer (through its ``backend_tokenizer``) is accepted as well.
    """

    @property
    def vocab_size(self) -> int: ...  # number of ids, added tokens included

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...


def engram_normalizer() -> normalizers.Normalizer:
    """The text normaliser whose output keys the compressed vocabulary."""
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _LONE_SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_LONE_SPACE_SENTINEL, " "),
        ]
    )


def compressed_key(text: str, raw_token: str | None, normalizer: normalizers.Normalizer) -> str | None:
    """The key a token is grouped by: its normalised text, or a raw fallback (see module doc)."""
    if REPLACEMENT_CHARACTER in text:
        return raw_token
    return normalizer.normalize_str(text) or text


def _decoded_vocabulary(tokenizer: Any) -> tuple[list[str], Callable[[int], str | None]]:
    """Every id decoded alone (special tokens kept), and the tokenizer's ``id_to_token``."""
    if isinstance(tokenizer, tokenizers.Tokenizer):
        backend, size = tokenizer, tokenizer.get_vocab_size(with_added_tokens=True)
    elif hasattr(tokenizer, "backend_tokenizer"):  # Hugging Face fast tokenizer
        backend, size = tokenizer.backend_tokenizer, len(tokenizer)
    else:
        backend, size = None, int(tokenizer.vocab_size)
    if backend is not None:
        texts = backend.decode_batch([[token_id] for token_id in range(size)], skip_special_tokens=False)
        return texts, backend.id_to_token
    texts = [tokenizer.decode([token_id], skip_special_tokens=False) for token_id in range(size)]
    return texts, tokenizer.id_to_token


def build_compressed_vocabulary(tokenizer: TokenizerLike | Any, expected_size: int | None = None) -> torch.Tensor:
    """Return the int64 table ``[vocab_size]`` mapping each token id to its compressed id.

    ``expected_size`` is ``engram_compressed_vocab_size``; when given, a tokenizer that
    yields a different number of compressed ids raises ``ValueError`` (the checkpoint's
    hashes were computed for exactly that size).
    """
    texts, id_to_token = _decoded_vocabulary(tokenizer)
    normalizer = engram_normalizer()
    compressed_ids: dict[str | None, int] = {}
    table = [0] * len(texts)
    for token_id, text in enumerate(texts):
        key = compressed_key(text, id_to_token(token_id), normalizer)
        table[token_id] = compressed_ids.setdefault(key, len(compressed_ids))
    if expected_size is not None and len(compressed_ids) != expected_size:
        raise ValueError(
            f"the tokenizer yields {len(compressed_ids)} compressed Engram ids but "
            f"engram_compressed_vocab_size is {expected_size}: this tokenizer does not belong to the "
            "checkpoint (the Engram hashes were computed for that exact size)"
        )
    return torch.tensor(table, dtype=torch.int64)
