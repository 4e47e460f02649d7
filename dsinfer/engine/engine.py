"""The engine core: requests in, tokens out, one ``step()`` at a time.

``step()`` schedules (which sequences, how many tokens), runs the model over the shared cache, samples the
sequences whose last token ran, applies stop conditions and frees what finished. An async server loop or the
offline :class:`~dsinfer.llm.LLM` drives it.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass

import torch

from dsinfer.config import EngineConfig
from dsinfer.engine.block_manager import BlockManager
from dsinfer.engine.model_runner import ModelRunner
from dsinfer.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from dsinfer.engine.sampler import Sampler, make_sampling_state
from dsinfer.engine.scheduler import Scheduler
from dsinfer.engine.sequence import Sequence
from dsinfer.models.deepseek_v4 import DeepseekV4
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

log = logging.getLogger("dsinfer.engine")


@dataclass
class StepStats:
    """Where a step's time went: host-side scheduling and bookkeeping vs. the model forward."""

    schedule_s: float
    model_s: float
    postprocess_s: float
    num_tokens: int


class LLMEngine:
    def __init__(self, model: DeepseekV4, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_model_len = config.resolved_max_model_len(model.config)
        self.runner = ModelRunner(model, config, self.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, self.runner.block_tokens, config.enable_prefix_caching)
        replay = model.config.num_hidden_layers * model.config.sliding_window
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill, replay
        )
        self.sampler = Sampler()
        self.requests: dict[str, list[Sequence]] = {}
        self._ids = itertools.count()
        self.last_step: StepStats | None = None
        self._grammar_compiler = None  # built on the first structured-output request

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request; validates it first (bad input raises ``ValueError`` and changes nothing)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_ids = self._prompt_ids(prompt)
        now = time.monotonic()
        sequences = []
        for i in range(params.n):
            state = make_sampling_state(
                params, prompt_ids, self.tokenizer.eos_id, sample_index=i, constraint=self._constraint(params)
            )
            sequences.append(Sequence(request_id, i, list(prompt_ids), state, now))
        self.requests[request_id] = sequences
        for seq in sequences:
            self.scheduler.add(seq)
        return request_id

    def _constraint(self, params: SamplingParams):
        """A fresh grammar constraint for one sequence, when the request asks for structured output."""
        wanted = params.structured_output
        if wanted is None:
            return None
        if self._grammar_compiler is None:
            from dsinfer.engine.structured_output import StructuredOutputCompiler  # xgrammar imports slowly

            self._grammar_compiler = StructuredOutputCompiler(self.tokenizer, vocab_size=self.model.config.vocab_size)
        return self._grammar_compiler.make_constraint(wanted, start_after_token=wanted.start_after_token)

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, allow_special=False)
            if self.tokenizer.bos_id is not None:
                ids = [self.tokenizer.bos_id, *ids]
        else:
            ids = list(prompt)
            vocab = self.model.config.vocab_size
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

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its cache; unknown or finished ids are ignored."""
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                seq.finish_reason = "abort"
                seq.finish_time = time.monotonic()
                self.scheduler.finish(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; report every request that changed (new tokens or finished)."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        scheduled_at = time.perf_counter()
        touched: dict[str, None] = {}
        if plan.scheduled:
            logits = self.runner.run(plan.scheduled)
            if logits.device.type == "cuda":
                torch.cuda.synchronize(logits.device)
            ran_at = time.perf_counter()
            sampled = [item.seq for item in plan.scheduled if item.completes_sequence]
            for item in plan.scheduled:
                item.seq.num_computed += item.num_new_tokens
                self.blocks.register_computed(item.seq)
            results = self.sampler(logits, [seq.sampling for seq in sampled]) if sampled else []
            now = time.monotonic()
            for seq, result in zip(sampled, results, strict=True):
                self._append(seq, result, now)
                touched[seq.request_id] = None
        else:
            ran_at = scheduled_at
        outputs = [self._request_output(rid) for rid in touched]
        for rid in touched:
            if all(seq.is_finished for seq in self.requests[rid]):
                del self.requests[rid]
        end = time.perf_counter()
        self.last_step = StepStats(scheduled_at - start, ran_at - scheduled_at, end - ran_at, plan.num_tokens)
        return outputs

    def _append(self, seq: Sequence, result, now: float) -> None:
        token = result.token_ids[0]
        seq.output_token_ids.append(token)
        constraint = seq.sampling.constraint
        violated = False
        if constraint is not None:
            try:
                constraint.accept(token)
            except ValueError:  # a token the grammar forbids: end this sequence, never the engine
                log.warning("request %s produced a token its grammar forbids; ending it", seq.request_id)
                violated = True
        if result.logprobs is not None:
            seq.output_logprobs.append(result.logprobs[0])
            seq.output_top_logprobs.append(result.top_logprobs[0] if result.top_logprobs else [])
        if seq.first_token_time is None:
            seq.first_token_time = now
        params = seq.sampling.params
        stopped_by_token = token in seq.sampling.stop_token_ids and len(seq.output_token_ids) >= params.min_tokens
        seq.text = self._detokenize(seq, drop_last=stopped_by_token)
        reason = None
        if violated:
            reason = "abort"
        elif stopped_by_token or (constraint is not None and constraint.is_terminated()):
            reason = "stop"
        elif params.stop and len(seq.output_token_ids) >= params.min_tokens:
            reason = self._apply_stop_strings(seq, params)
        if reason is None and params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens:
            reason = "length"
        if reason is None and seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            seq.finish_time = now
            self.scheduler.finish(seq)

    def _detokenize(self, seq: Sequence, drop_last: bool) -> str:
        ids = seq.output_token_ids[:-1] if drop_last else seq.output_token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=seq.sampling.params.skip_special_tokens)

    @staticmethod
    def _apply_stop_strings(seq: Sequence, params: SamplingParams) -> str | None:
        """Cut the text at the first stop string; the stop string stays only if asked for."""
        hits = [(seq.text.find(stop), stop) for stop in params.stop if stop and stop in seq.text]
        if not hits:
            return None
        position, stop = min(hits)
        end = position + len(stop) if params.include_stop_str_in_output else position
        seq.text = seq.text[:end]
        return "stop"

    def _request_output(self, request_id: str) -> RequestOutput:
        sequences = self.requests[request_id]
        first = sequences[0]
        completions = [
            CompletionOutput(
                seq.index,
                seq.text,
                list(seq.output_token_ids),
                seq.finish_reason,
                list(seq.output_logprobs) if seq.sampling.params.logprobs is not None else None,
                list(seq.output_top_logprobs) if seq.sampling.params.logprobs else None,
            )  # fmt: skip
            for seq in sequences
        ]
        finished_times = [s.finish_time for s in sequences]
        first_tokens = [s.first_token_time for s in sequences if s.first_token_time is not None]
        scheduled = [s.first_scheduled_time for s in sequences if s.first_scheduled_time is not None]
        metrics = RequestMetrics(
            first.arrival_time,
            min(scheduled) if scheduled else None,
            min(first_tokens) if first_tokens else None,
            max(finished_times) if all(t is not None for t in finished_times) else None,
        )
        finished = all(seq.is_finished for seq in sequences)
        return RequestOutput(request_id, list(first.prompt_token_ids), completions, finished, metrics)
