"""Offline API: ``LLM(model).generate(prompts, SamplingParams)``; ``close()`` (or ``with LLM(...)``) when done.

Closing matters for V4.1 checkpoints loaded with ``engram_placement='host'`` or ``'sharded'``: the model then
maps its Engram tables from a shared-memory segment (:mod:`dsinfer.engram.placement`), which closing unmaps.
"""

from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path

import torch
from tqdm import tqdm

from dsinfer.config import EngineConfig, ModelConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.engine.outputs import RequestOutput
from dsinfer.hub import resolve_model_dir
from dsinfer.models.dummy import LOAD_FORMATS
from dsinfer.models.tiny import default_model_dir
from dsinfer.parallel.config import ParallelConfig
from dsinfer.parallel.engine_loop import DTYPES, load_engine_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

__all__ = ["DTYPES", "LLM"]


class LLM:
    """Load a checkpoint (default: the embedded default model) and generate for batches of prompts.

    ``options`` override fields of ``config`` (:class:`~dsinfer.config.EngineConfig`), e.g.
    ``LLM(path, engram_placement="host")``, or of ``parallel`` (:class:`~dsinfer.parallel.config.ParallelConfig`),
    e.g. ``LLM(path, data_parallel_size=2, expert_parallel_size=2)``: with more than one rank the model runs in
    one process per rank (:mod:`dsinfer.parallel`) and this process holds no weights (``self.model`` is None).
    ``load_format="dummy"`` reads only the directory's config and tokenizer and draws random weights
    (:mod:`dsinfer.models.dummy`), for measuring a shape without its checkpoint; it runs one rank.
    ``engine_process=True`` runs one rank's engine in a process of its own too, as ``dsinfer serve`` does by
    default (the same tokens; this process then holds no weights): offline, the engine in this process is the
    default, since no other work here competes with its step for the Python lock.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        config: EngineConfig | None = None,
        parallel: ParallelConfig | None = None,
        load_format: str = "auto",
        engine_process: bool = False,
        revision: str | None = None,
        download_dir: str | Path | None = None,
        **options,
    ) -> None:
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format: expected one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
        parallel_names = {f.name for f in fields(ParallelConfig)}
        parallel_options = {k: options.pop(k) for k in list(options) if k in parallel_names}
        config = replace(config or EngineConfig(), **options)
        parallel = replace(parallel or ParallelConfig(), **parallel_options)
        # A directory, or a Hugging Face repository id (ORG/NAME) fetched into (or found in) the hub's cache.
        model_dir = resolve_model_dir(model, revision, download_dir) if model is not None else default_model_dir()
        self.model_dir = model_dir
        self._chat_format = None  # the chat protocol (deepseek-recipe) loads on the first chat()
        if torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r}: no CUDA device is available")
        self.model = None
        if parallel.is_multi_rank and load_format == "dummy":
            raise ValueError("load_format 'dummy' runs one rank: leave out the data / expert parallel sizes")
        if parallel.is_multi_rank or engine_process:
            from dsinfer.parallel.ranked_engine import RankedEngine  # the engine processes and their pipes

            self.tokenizer = Tokenizer.from_dir(model_dir)
            self.engine = RankedEngine(
                str(model_dir), self.tokenizer, ModelConfig.from_file(model_dir), config, parallel,
                load_format=load_format,
            )  # fmt: skip
            return
        self.model = load_engine_model(model_dir, config, load_format)
        try:
            self.tokenizer = Tokenizer.from_dir(model_dir)
            self.engine = LLMEngine(self.model, self.tokenizer, config)
        except BaseException:
            self._release_model()
            raise

    def close(self) -> None:
        """Stop the engine (a step in flight finishes first), then release the model's Engram tables. Idempotent."""
        self.engine.close()
        self._release_model()

    def _release_model(self) -> None:
        if self.model is not None:
            self.model.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        ids = [self.engine.add_request(p, sp or SamplingParams()) for p, sp in zip(prompts, params, strict=True)]
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        bar.update(1)
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list,
        sampling_params: SamplingParams | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}`` messages) or a batch of them.

        The prompt is the one ``/v1/chat/completions`` runs (deepseek-recipe's encoding; ``tools`` in OpenAI's
        form; ``chat_template_kwargs={"thinking": True}`` for thinking mode) and the output is parsed the same
        way: each completion's ``text`` is the answer, ``reasoning`` the thinking, ``tool_calls`` the calls.
        Sampling defaults to greedy with up to 512 tokens (:data:`~dsinfer.offline_chat.DEFAULT_CHAT_PARAMS`).
        """
        chat_format = self.chat_format()
        from dsinfer.offline_chat import DEFAULT_CHAT_PARAMS, conversations_of, parsed_output, prepare_chat

        params = sampling_params or DEFAULT_CHAT_PARAMS
        prepared = [prepare_chat(chat_format, conversation, params, tools, chat_template_kwargs)
                    for conversation in conversations_of(messages)]  # fmt: skip
        outputs = self.generate([p.prompt_ids for p, _ in prepared], [sp for _, sp in prepared], use_tqdm=use_tqdm)
        return [parsed_output(chat_format, p, output) for (p, _), output in zip(prepared, outputs, strict=True)]

    def chat_format(self):
        """The chat format of this checkpoint (V4.1 prompts for V4.1 checkpoints), built on first use."""
        if self._chat_format is None:
            config = self.model.config if self.model is not None else ModelConfig.from_file(self.model_dir)
            variant = config.family
            from dsinfer.chat.format import ChatFormat

            self._chat_format = ChatFormat(self.tokenizer, variant, "offline")
        return self._chat_format
