"""Incremental detokenization: each new token costs a decode of a few tokens, not of the whole output.

Decoding a sequence's whole output after every token is quadratic in its length. Here each sequence keeps
two offsets into its output ids: ``prefix`` (where a short decoding context starts) and ``read`` (the end of
what has already been turned into text). A new token's text is ``decode(ids[prefix:]) - decode(ids[prefix:read])``:
decoding with a few tokens of left context keeps whatever the decoder does at token boundaries (byte-level
BPE merges, spaces) identical to a full decode. Text that ends in U+FFFD is an unfinished UTF-8 character
(a multi-byte character split over tokens); it is held back until the next token completes it, or until
:meth:`IncrementalDetokenizer.flush` when the sequence ends, which then gives exactly what a full decode
gives.
"""

from __future__ import annotations

from dsinfer.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 6
"""Tokens of left context decoded with each new token (enough for any byte-level merge to settle)."""


class IncrementalDetokenizer:
    """Turns one sequence's output ids into text as they arrive.

    ``push(token_ids)`` takes the ids appended since the last call (the caller keeps the id list) and
    returns the new text; ``flush()`` returns what is held back at the end.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the decoding context
        self.read = 0  # ids before this are already text

    def push(self, token_ids: list[int]) -> str:
        """Add new ids; return the text they complete (may be empty while a character is unfinished)."""
        self.ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back (an unfinished character decodes to U+FFFD, as a full decode gives)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip_special_tokens)
        after = decode(self.ids[self.prefix :], skip_special_tokens=self.skip_special_tokens)
        if not final and after.endswith(REPLACEMENT_CHAR):
            return ""  # wait for the rest of the character
        if not after.startswith(before):
            # The context decoded differently once extended (never seen with byte-level BPE); fall back
            # to the longest common prefix so no text is emitted twice.
            common = 0
            while common < min(len(before), len(after)) and before[common] == after[common]:
                common += 1
            before = before[:common]
        new_text = after[len(before) :]
        self.read = len(self.ids)
        self.prefix = max(0, self.read - CONTEXT_TOKENS)
        return new_text
