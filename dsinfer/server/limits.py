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
