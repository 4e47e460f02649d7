"""Request sets for ``dsinfer bench serve``: random prompts of a set token length, or a JSONL file.

The benchmark talks to any OpenAI-compatible server and has no tokenizer of its own, so a random prompt is
built from common English words and, where the server offers ``POST /tokenize`` (vLLM, SGLang, dsinfer),
measured with the server's own tokenizer until it is exactly ``input_len`` tokens as the server counts
them (chat template and BOS included). Without ``/tokenize`` one word stands for one token; the server's
``usage.prompt_tokens`` is the truth either way.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dsinfer.config.json_object import json_object

# Short, frequent words: one token each (with their leading space) in every large BPE vocabulary.
WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him two"
).split()


FIRST_WORDS = 8  # a prompt starts with one of the first few words (no leading space, so its own cost)


class DatasetError(ValueError):
    """A dataset file or option that cannot be used; the message names the file and line."""


@dataclass
class BenchRequest:
    """One request to send: a text prompt or chat messages, the tokens to generate, the expected prompt size."""

    prompt: str | None
    messages: list[dict[str, Any]] | None
    output_len: int
    prompt_tokens: int | None = None  # as the server's /tokenize counted it, or the word-count estimate

    def chat_messages(self) -> list[dict[str, Any]]:
        return self.messages if self.messages is not None else [{"role": "user", "content": self.prompt}]


# ---- JSONL ---------------------------------------------------------------------------------------
def load_jsonl(path: Path, endpoint: str, default_output_len: int) -> list[BenchRequest]:
    """One JSON object per line: ``prompt`` (text) or ``messages`` (chat), optional ``output_len``."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"--dataset-path {path}: cannot read: {exc}") from None
    requests = [
        _jsonl_request(line, f"{path}:{number}", endpoint, default_output_len)
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]
    if not requests:
        raise DatasetError(f"--dataset-path {path}: no requests (the file has no non-empty lines)")
    return requests


def _jsonl_request(line: str, where: str, endpoint: str, default_output_len: int) -> BenchRequest:
    entry = json_object(line, where, DatasetError)
    prompt, messages = entry.get("prompt"), entry.get("messages")
    if (prompt is None) == (messages is None):
        raise DatasetError(f"{where}: give exactly one of 'prompt' (a string) or 'messages' (a list)")
    if prompt is not None and not isinstance(prompt, str):
        raise DatasetError(f"{where}: 'prompt' must be a string")
    if messages is not None:
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) and "role" in m for m in messages)):
            raise DatasetError(f"{where}: 'messages' must be a non-empty list of objects with a 'role'")
        if endpoint != "chat":
            raise DatasetError(f"{where}: 'messages' needs --endpoint chat (the completions endpoint takes 'prompt')")
    output_len = entry.get("output_len", default_output_len)
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
        raise DatasetError(f"{where}: 'output_len' must be a positive integer, got {output_len!r}")
    return BenchRequest(prompt=prompt, messages=messages, output_len=output_len)


def repeat_to(requests: list[BenchRequest], count: int) -> list[BenchRequest]:
    """The first ``count`` requests, cycling through the file when it is shorter."""
    return [requests[i % len(requests)] for i in range(count)]


# ---- random prompts ------------------------------------------------------------------------------
class ServerTokenCounter:
    """Counts prompt tokens with the server's ``POST /tokenize`` exactly as a request of ``endpoint`` would."""

    def __init__(self, client: httpx.AsyncClient, server_url: str, model: str, endpoint: str, parallel: int = 16):
        self.client, self.url, self.model, self.endpoint = client, f"{server_url}/tokenize", model, endpoint
        self.gate = asyncio.Semaphore(parallel)

    async def count(self, text: str) -> int:
        async with self.gate:
            return await self._count(text)

    async def _count(self, text: str) -> int:
        body: dict[str, Any] = {"model": self.model}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        response = await self.client.post(self.url, json=body)
        response.raise_for_status()
        data = response.json()
        count = data.get("count", len(data["tokens"]) if "tokens" in data else None)
        if not isinstance(count, int):
            raise ValueError("/tokenize answered without 'count' or 'tokens'")
        return count


@dataclass
class WordCosts:
    """Tokens a word adds at the start of the prompt and after a space, and the empty prompt's own tokens."""

    empty: int
    first: dict[str, int]
    next: dict[str, int]


async def measure_word_costs(counter: ServerTokenCounter) -> WordCosts:
    """Ask the server what each vocabulary word costs; pre-tokenizers split on spaces, so costs add up."""
    anchor = WORDS[0]
    empty, anchored = await asyncio.gather(counter.count(""), counter.count(anchor))
    alone = await asyncio.gather(*(counter.count(word) for word in WORDS[:FIRST_WORDS]))
    after = await asyncio.gather(*(counter.count(f"{anchor} {word}") for word in WORDS))
    first = {w: a - empty for w, a in zip(WORDS, alone, strict=False) if a > empty}
    following = {w: n - anchored for w, n in zip(WORDS, after, strict=True) if n > anchored}
    if not first or not following:
        raise ValueError("/tokenize counts do not grow with the text")
    return WordCosts(empty=empty, first=first, next=following)


def compose_prompt(rng: random.Random, target: int, costs: WordCosts) -> str:
    """Random words whose token costs sum to ``target`` (or as close below as the costs allow)."""
    cheapest_first = min(costs.first.values())
    first_choices = [w for w, c in costs.first.items() if costs.empty + c <= target or c == cheapest_first]
    words = [rng.choice(first_choices)]
    total = costs.empty + costs.first[words[0]]
    candidates = sorted(costs.next.items())  # a fixed order, so the seed alone decides the words
    smallest = min(cost for _, cost in candidates)
    while total < target:
        remaining = target - total
        # A word fits when it hits the target exactly or leaves room for at least the cheapest word.
        fits = [w for w, c in candidates if c == remaining or remaining - c >= smallest]
        if not fits:
            break
        word = rng.choice(fits)
        words.append(word)
        total += costs.next[word]
    return " ".join(words)


def word_prompt(rng: random.Random, target: int) -> str:
    """Without a server tokenizer: ``target`` random words, about one token each in large vocabularies."""
    return " ".join(rng.choice(WORDS) for _ in range(max(1, target)))


async def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int,
    counter: ServerTokenCounter | None,
) -> tuple[list[BenchRequest], str]:
    """Seeded random prompts; returns them and a note on how their lengths were checked (for the report)."""
    rng = random.Random(f"dataset-{seed}")
    costs, why = None, "no tokenizer check"
    if counter is not None:
        try:
            costs = await measure_word_costs(counter)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            why = f"the server has no usable /tokenize: {type(exc).__name__}"
    if costs is None:
        requests = [BenchRequest(word_prompt(rng, input_len), None, output_len) for _ in range(num_prompts)]
        return requests, f"prompts are {input_len} words, about one token each ({why})"
    texts = [compose_prompt(rng, input_len, costs) for _ in range(num_prompts)]
    counts = await asyncio.gather(*(counter.count(text) for text in texts))
    requests = [BenchRequest(text, None, output_len, prompt_tokens=n) for text, n in zip(texts, counts, strict=True)]
    off = sum(n != input_len for n in counts)
    note = f"server /tokenize confirmed {num_prompts - off}/{num_prompts} prompts at {input_len} tokens"
    if off:
        note += f" (the others: {min(counts)}..{max(counts)} tokens)"
    return requests, note
