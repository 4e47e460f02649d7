"""Where generations come from: any OpenAI-compatible server, or our engine in this process.

Both backends take the same :class:`GenerationOptions` and report one result dict per sample through a
callback on the calling thread (the only thread that writes records), in completion order. A failed sample is
a result with ``error`` set, never an exception: one bad request must not stop an eval of thousands.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dsinfer.eval.datasets import EvalError, SampleRequest

#: ``--reasoning-effort`` values; ``none`` turns thinking mode off (chat mode).
REASONING_EFFORTS = ("none", "low", "medium", "high", "max")

T = TypeVar("T")
R = TypeVar("R")
ResultCallback = Callable[[SampleRequest, dict[str, Any]], None]


@dataclass(frozen=True)
class GenerationOptions:
    temperature: float
    top_p: float
    max_tokens: int
    reasoning_effort: str

    @property
    def thinking(self) -> bool:
        return self.reasoning_effort != "none"


def empty_result(error: str | None = None) -> dict[str, Any]:
    return {"response": None, "reasoning": None, "finish_reason": None, "usage": None, "error": error}


def normalize_base_url(url: str) -> str:
    """``http://host:port`` and ``http://host:port/v1`` both name the server; the client wants the ``/v1`` root."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise EvalError(f"base URL {url!r} must start with http:// or https://")
    return url if url.endswith("/v1") else url + "/v1"


def openai_client(base_url: str, api_key: str | None, timeout: float, max_retries: int):
    import openai

    return openai.OpenAI(
        base_url=normalize_base_url(base_url), api_key=api_key or "EMPTY", timeout=timeout, max_retries=max_retries
    )


def resolve_model(client, model: str | None, base_url: str) -> str:
    """The model to ask for: the one given, else the only one the server lists. Checks the server answers, so
    an unreachable URL is one clear error instead of thousands of failed samples."""
    import openai

    try:
        listed = [card.id for card in client.models.list().data]
    except openai.APIConnectionError as exc:
        raise EvalError(f"cannot reach {base_url}: {exc}") from None
    except openai.OpenAIError as exc:
        if model:
            return model  # some endpoints do not list models; the named one may still work
        raise EvalError(f"cannot list models at {base_url}: {exc}; pass --model") from None
    if model:
        return model
    if len(listed) != 1:
        raise EvalError(f"{base_url} serves {len(listed)} models ({', '.join(listed)}); pass --model to pick one")
    return listed[0]


class OpenAIBackend:
    """Chat Completions against any OpenAI-compatible server (dsinfer serve, vLLM, SGLang, a hosted API).

    Thinking mode is requested the way DeepSeek servers read it: ``chat_template_kwargs.thinking`` plus
    ``reasoning_effort``. Retries (429, 5xx, connection errors) are the ``openai`` client's, with backoff.
    """

    def __init__(self, base_url: str, model: str | None, api_key: str | None, timeout: float, max_retries: int):
        self.base_url = normalize_base_url(base_url)
        self.client = openai_client(base_url, api_key, timeout, max_retries)
        self.model = resolve_model(self.client, model, self.base_url)

    def describe(self) -> dict[str, Any]:
        return {"backend": "openai", "base_url": self.base_url, "model": self.model}

    def generate_one(self, request: SampleRequest, options: GenerationOptions) -> dict[str, Any]:
        import openai

        extra: dict[str, Any] = {"chat_template_kwargs": {"thinking": options.thinking}}
        if options.thinking:
            extra["reasoning_effort"] = options.reasoning_effort
        try:
            response = self.client.chat.completions.create(
                model=self.model,
                messages=request.messages,
                max_tokens=options.max_tokens,
                temperature=options.temperature,
                top_p=options.top_p,
                seed=request.seed,
                extra_body=extra,
            )
        except openai.OpenAIError as exc:
            return empty_result(f"{type(exc).__name__}: {exc}")
        if not response.choices:
            return empty_result("the server returned no choices")
        choice = response.choices[0]
        message = choice.message
        reasoning = getattr(message, "reasoning_content", None) or getattr(message, "reasoning", None) or None
        usage = response.usage.model_dump(exclude_none=True) if response.usage is not None else None
        return {"response": message.content or "", "reasoning": reasoning, "finish_reason": choice.finish_reason,
                "usage": usage, "error": None}  # fmt: skip

    def run(
        self, requests: list[SampleRequest], options: GenerationOptions, concurrency: int, on_result: ResultCallback
    ) -> None:
        """At most ``concurrency`` requests in flight; results handed to ``on_result`` on this thread."""

        def work(request: SampleRequest) -> dict[str, Any]:
            started_at, start = time.time(), time.perf_counter()
            try:
                result = self.generate_one(request, options)
            except Exception as exc:  # reported as this sample's error: the run goes on
                result = empty_result(f"{type(exc).__name__}: {exc}")
            result["timing"] = _timing(started_at, start)
            return result

        run_concurrently(requests, work, concurrency, on_result)


def run_concurrently(items: list[T], work: Callable[[T], R], concurrency: int, on_done: Callable[[T, R], None]) -> None:
    """Run ``work`` on every item with at most ``concurrency`` in flight; ``on_done`` runs on the calling thread.

    Workers are daemon threads, so an interrupted run (Ctrl-C, an exception from ``on_done``) ends at once
    instead of waiting for slow in-flight requests, whose results a rerun regenerates anyway. ``work`` should
    report failures in its result; an exception it raises anyway stops the run here, on the calling thread.
    """
    pending = deque(items)
    finished: queue.Queue[tuple[T, R | None, BaseException | None]] = queue.Queue()

    def run_one(item: T) -> None:
        try:
            finished.put((item, work(item), None))
        except BaseException as exc:  # handed to the calling thread, which re-raises it
            finished.put((item, None, exc))

    running = 0
    while pending or running:
        while pending and running < concurrency:
            threading.Thread(target=run_one, args=(pending.popleft(),), daemon=True, name="eval-worker").start()
            running += 1
        item, result, failure = finished.get()
        running -= 1
        if failure is not None:
            raise failure
        on_done(item, result)


class OfflineBackend:
    """Our engine in this process (``--model-dir``): the prompt is rendered with dsinfer's own chat encoder (the
    V4 format, or V4.1 for a ``deepseek_v41`` checkpoint) and the output split into reasoning and answer by the
    server's response parser, so results match what ``dsinfer serve`` returns for the same request."""

    def __init__(self, model_dir: str | Path, device: str, dtype: str, max_num_seqs: int, max_model_len: int | None):
        from dsinfer.llm import LLM

        options: dict[str, Any] = {"device": device, "dtype": dtype, "max_num_seqs": max_num_seqs}
        if max_model_len is not None:
            options["max_model_len"] = max_model_len
        self.model_dir = Path(model_dir).resolve()
        self.llm = LLM(self.model_dir, **options)
        from dsinfer.chat.format import ChatFormat

        model_type = str(getattr(self.llm.engine.model.config, "model_type", ""))
        self.chat_variant = "v41" if model_type.startswith("deepseek_v41") else "v4"
        from dsinfer.chat.image_reader import ImageReader

        vision = getattr(self.llm.engine.model.config, "vision", None)
        reader = ImageReader(vision) if vision is not None else None  # HLE image questions
        self.chat_format = ChatFormat(self.llm.tokenizer, self.chat_variant, "eval", image_reader=reader)

    def describe(self) -> dict[str, Any]:
        return {"backend": "offline", "base_url": None, "model": str(self.model_dir)}

    def run(
        self, requests: list[SampleRequest], options: GenerationOptions, concurrency: int, on_result: ResultCallback
    ) -> None:
        import deepseek_recipe as recipe

        from dsinfer.sampling_params import SamplingParams

        engine = self.llm.engine
        pending = deque(requests)
        running: dict[str, tuple[SampleRequest, float, float, int]] = {}
        try:
            while pending or running:
                while pending and len(running) < concurrency:
                    request = pending.popleft()
                    started_at, start = time.time(), time.perf_counter()
                    try:
                        prepared = self._prepared(request, options)
                        prompt_ids = prepared.prompt_ids
                        params = SamplingParams(max_tokens=options.max_tokens, temperature=options.temperature,
                                                top_p=options.top_p, seed=request.seed)  # fmt: skip
                        request_id = engine.add_request(prompt_ids, params, images=prepared.images)
                    except (ValueError, recipe.ConversionError) as exc:
                        result = empty_result(f"{type(exc).__name__}: {exc}")
                        result["timing"] = _timing(started_at, start)
                        on_result(request, result)
                        continue
                    running[request_id] = (request, started_at, start, prepared)
                if not running:
                    continue
                if not engine.has_unfinished_requests():
                    raise RuntimeError("the engine has no work left but requests are still running")
                for output in engine.step():
                    if output.finished and output.request_id in running:
                        request, started_at, start, prepared = running.pop(output.request_id)
                        result = self._result(output, options, prepared, self.chat_format)
                        result["timing"] = _timing(started_at, start)
                        on_result(request, result)
        finally:
            for request_id in running:
                engine.abort(request_id)

    def _prepared(self, request: SampleRequest, options: GenerationOptions):
        """The prompt exactly as ``dsinfer serve`` renders this chat (thinking on / off, effort line)."""
        body: dict[str, Any] = {"messages": request.messages,
                                "thinking": {"type": "enabled" if options.thinking else "disabled"}}  # fmt: skip
        if options.thinking and options.reasoning_effort:
            body["reasoning_effort"] = options.reasoning_effort
        return self.chat_format.prepare("chat", body)

    @staticmethod
    def _result(output, options: GenerationOptions, prepared, chat_format) -> dict[str, Any]:
        import deepseek_recipe as recipe

        from dsinfer.chat.stream import ChoiceStream

        completion = output.outputs[0]
        generator = recipe.ChatCompletionRequest.chunk_generator(prepared.request, "eval", "eval")
        response = recipe.ChatCompletionResponse("eval", "eval", 0, len(prepared.prompt_ids), 0)
        for event in ChoiceStream(chat_format, prepared, generator).push(completion):
            response.accumulate(event)
        message = json.loads(response.to_json())["choices"][0]["message"]
        prompt_tokens, generated = len(prepared.prompt_ids), len(completion.token_ids)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": generated,
                 "total_tokens": prompt_tokens + generated}  # fmt: skip
        reasoning = (message.get("reasoning_content") or "") if options.thinking else None
        return {"response": message.get("content") or "", "reasoning": reasoning,
                "finish_reason": completion.finish_reason, "usage": usage, "error": None}  # fmt: skip


def _timing(started_at: float, start: float) -> dict[str, float]:
    return {"started_at": round(started_at, 3), "latency_s": round(time.perf_counter() - start, 3)}
