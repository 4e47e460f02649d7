"""Per-request limits checked before anything reaches the engine: completions per request, context length.

Answers follow OpenAI (and vLLM): a request whose prompt plus ``max_tokens`` exceeds the context is a 400
naming the field to shorten, never a completion silently cut at the context's end. Without an explicit
``max_tokens`` the server's default is lowered to the room the prompt leaves, as vLLM does.
"""

from __future__ import annotations

DEFAULT_MAX_N = 128  # OpenAI's documented maximum for n


class LimitError(ValueError):
    """A request beyond a limit; ``param`` names the field and ``code`` is OpenAI's error code."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def check_n(n: int, num_prompts: int, max_n: int) -> None:
    """At most ``max_n`` sequences per request (``n`` times the prompts of a batched completion)."""
    if n * num_prompts > max_n:
        what = f"n = {n}" if num_prompts == 1 else f"n = {n} for {num_prompts} prompts ({n * num_prompts} completions)"
        raise LimitError(f"{what} is above this server's limit of {max_n} completions per request (--max-n)", "n")


def completion_budget(
    prompt_len: int,
    max_tokens: int | None,
    max_model_len: int,
    default_max_tokens: int,
    prompt_field: str,
    max_tokens_field: str,
) -> int:
    """The ``max_tokens`` to run with, or a ``LimitError`` when the prompt and the completion do not fit.

    ``prompt_field`` names the request's prompt (``messages`` in chat, ``prompt`` in text completions) and
    ``max_tokens_field`` the completion length field the client set (``max_tokens`` or ``max_completion_tokens``).
    """
    if prompt_len >= max_model_len:
        raise LimitError(
            f"This model's maximum context length is {max_model_len} tokens. However, your {prompt_field} "
            f"resulted in {prompt_len} tokens, which leaves no room for a completion. Please reduce the length "
            f"of the {prompt_field}.",
            prompt_field,
            "context_length_exceeded",
        )
    room = max_model_len - prompt_len
    if max_tokens is None:
        return min(default_max_tokens, room)
    if max_tokens > room:
        raise LimitError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_field}, {max_tokens} in the completion). "
            f"Please reduce the length of the {prompt_field} or completion.",
            max_tokens_field,
            "context_length_exceeded",
        )
    return max_tokens


#: The shared limits of every route (chat, completions, Responses, Messages), as deepseek-recipe enforces them
#: for the chat-style routes: a request refused on one route is refused on all.
MAX_STOP_SEQUENCES = 16
SEED_RANGE = (0, 2**63 - 1)

#: The body fields whose text becomes prompt tokens, per protocol; the first names the prompt in errors.
PROMPT_FIELDS: dict[str, tuple[str, ...]] = {
    "chat": ("messages", "tools"),
    "responses": ("input", "instructions", "tools"),
    "messages": ("messages", "system", "tools"),
}

#: Where each protocol's body gives the output's JSON schema (errors name it).
SCHEMA_FIELDS = {"chat": "response_format", "responses": "text.format", "messages": "output_format"}

# Normalization may merge characters (NFKC composes an accent with its letter): count at most one token per
# this many of a token's longest spelling, so the quick refusal below never refuses a prompt that would fit.
NORMALIZATION_SLACK = 4


def text_chars(value) -> int:
    """Characters of every string in a JSON value but image data (``data:`` URLs become image tokens)."""
    total = 0
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += 0 if item.startswith("data:") else len(item)
        elif isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return total


def check_text_fits(chars: int, max_model_len: int, max_token_chars: int, field: str) -> None:
    """Refuse, without tokenizing it, a text too long for the context however the tokenizer splits it.

    No token spells more than ``max_token_chars`` characters, so ``chars`` characters are at least
    ``chars / max_token_chars`` tokens. Tokenizing a 10 MB body only to refuse it would cost seconds of CPU and
    gigabytes of memory in the API process.
    """
    least_tokens = chars // (NORMALIZATION_SLACK * max(1, max_token_chars))
    if least_tokens >= max_model_len:
        raise LimitError(
            f"This model's maximum context length is {max_model_len} tokens. However, your {field} has "
            f"{chars} characters, which is more than {least_tokens} tokens. Please reduce the length of the {field}.",
            field,
            "context_length_exceeded",
        )


def check_stop(stop, field: str = "stop") -> None:
    """At most :data:`MAX_STOP_SEQUENCES` stop strings (deepseek-recipe's limit on the chat routes)."""
    if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
        raise LimitError(f"{field} has {len(stop)} entries; at most {MAX_STOP_SEQUENCES} are allowed", field)
