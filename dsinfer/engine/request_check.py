"""A request checked once, before any engine takes it: its id, its prompt's token ids, its images.

The single-rank engine checks here before it queues a request; the ranked engine checks here in the API process
before it sends one to a rank, so bad input is answered the same way (one ``ValueError`` naming what was wrong)
and never reaches a rank.
"""

from __future__ import annotations

import itertools
from collections.abc import Container
from dataclasses import dataclass

from dsinfer.config import ModelConfig
from dsinfer.engine.image_spans import check_image_spans
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer


@dataclass(frozen=True)
class CheckedRequest:
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    images: tuple


class RequestChecker:
    """Checks requests against one model: its vocabulary, its vision tower, the context length.

    ``engram_vocabulary`` (V4.1): what its Engram hash maps (anything with a ``vocab_size``, read at each check):
    prompt ids must lie in it too, as the forward does not range-check ids (that would read them on the host)."""

    def __init__(
        self, tokenizer: Tokenizer, model_config: ModelConfig, max_model_len: int, engram_vocabulary=None
    ) -> None:
        self.tokenizer, self.model_config, self.max_model_len = tokenizer, model_config, max_model_len
        self.engram_vocabulary = engram_vocabulary
        self._ids = itertools.count()

    @property
    def vocab_size(self) -> int:
        """The token ids a prompt may hold: the model's, no more than its Engram hash maps."""
        if self.engram_vocabulary is None:
            return self.model_config.vocab_size
        return min(self.model_config.vocab_size, self.engram_vocabulary.vocab_size)

    def check(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str | None,
        images: list | None,
        in_use: Container[str],
    ) -> CheckedRequest:
        """The request as the engine takes it; ``ValueError`` for bad input (``in_use``: the ids taken now)."""
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in in_use:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_ids = self.prompt_token_ids(prompt)
        images = tuple(images or ())
        if images:
            check_image_spans(prompt_ids, images, self.model_config)
        return CheckedRequest(request_id, params or SamplingParams(), prompt_ids, images)

    def prompt_token_ids(self, prompt: str | list[int]) -> list[int]:
        """Text is encoded (with BOS); token ids must lie in the vocabulary; either must leave room to generate."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, allow_special=False)
            if self.tokenizer.bos_id is not None:
                ids = [self.tokenizer.bos_id, *ids]
        else:
            ids = list(prompt)
            vocab = self.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens, at or above max_model_len ({self.max_model_len}); no room to generate"
            )
        return ids
