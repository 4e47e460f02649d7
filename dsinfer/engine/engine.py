"""The engine core: requests in, tokens out, one ``step()`` at a time.

``step()`` schedules (which sequences, how many tokens), runs the model over the shared cache, samples the
sequences whose last token ran, applies stop conditions and frees what finished. An async server loop or the
offline :class:`~dsinfer.llm.LLM` drives it.

**Overlap scheduling** (``EngineConfig.async_scheduling``: by default on for CUDA, off on CPU, where the
forward runs on the very cores the scheduler would take). The forward and the sampler run on the device
worker's thread (:mod:`dsinfer.engine.device_worker`), so while step N runs there the engine thread already
schedules step N+1: every sequence sampled in step N counts one pending token, which lets the scheduler plan
its decode before the token exists; a sequence whose token in flight is its last by length gives its slot and
blocks back at once (:meth:`Scheduler.retire`). When step N's tokens arrive the engine applies the stop rules
that need no text, drops the sequences that ended from plan N+1, launches it, and only then detokenizes step
N's tokens (a stop string found there ends a sequence whose step N+1 result is then ignored). The worker runs
steps strictly in order, so memory that plan N+1 frees or hands to another sequence is only written by a
later forward. Tokens, text and finish reasons are the same with and without overlap
(tests/test_engine_overlap.py); a prompt may be split into prefill chunks at other points, which moves fp32
logits by rounding only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from dsinfer.config import EngineConfig
from dsinfer.engine.block_manager import BlockManager
from dsinfer.engine.cache_plan import ServedModel
from dsinfer.engine.client import EngineLoad
from dsinfer.engine.device_worker import DeviceWorker, StepHandle
from dsinfer.engine.model_runner import ModelRunner
from dsinfer.engine.output_processor import (
    CompletionText,
    completion_output,
    finish_reason_after_token,
    request_output,
)
from dsinfer.engine.outputs import RequestMetrics, RequestOutput
from dsinfer.engine.request_check import RequestChecker
from dsinfer.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from dsinfer.engine.sequence import Sequence
from dsinfer.engine.warmup import warm_up_kernels
from dsinfer.offload.traffic import poll_offload_traffic
from dsinfer.sampling.sampler import SampleOutput, Sampler, make_sampling_state, reads_output_so_far
from dsinfer.sampling_params import SamplingParams
from dsinfer.speculative.executor import SpeculativeExecutor, SpeculativeOutput, SpeculativeStats
from dsinfer.speculative.support import check_speculative_support
from dsinfer.tokenizer import Tokenizer


@dataclass
class StepStats:
    """Where a step's time went on the engine thread.

    ``schedule_s``: scheduling (with overlap: the next step's, while the device runs this one);
    ``model_s``: waiting for the forward and the sampler; ``postprocess_s``: stop rules, launching the next
    step, detokenization and outputs; ``num_tokens``: tokens of the step whose results came back.
    """

    schedule_s: float
    model_s: float
    postprocess_s: float
    num_tokens: int
    overlapped: bool = False


@dataclass
class InflightStep:
    """A step handed to the device worker: which sequences it samples, and its future sample outputs."""

    sampled: list[Sequence]
    handle: StepHandle
    num_tokens: int
    started: threading.Event | None = None  # launched ahead: set when the worker takes it up


class LLMEngine:
    """The engine in this process; it answers :class:`~dsinfer.engine.client.EngineClient`'s calls."""

    def __init__(self, model: ServedModel, tokenizer: Tokenizer, config: EngineConfig) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        if config.speculative_config is not None:
            check_speculative_support(model, config.speculative_config)
        self.max_model_len = config.resolved_max_model_len(model.config)
        self.runner = ModelRunner(model, config, self.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, self.runner.block_tokens, config.enable_prefix_caching)
        # After a prefix hit the windows are rebuilt by recomputing this many positions: a window KV depends on
        # at most `sliding_window` earlier inputs per layer (V4 and V4.1 alike; compressed entries are cached).
        replay = model.config.num_hidden_layers * model.config.sliding_window
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, config.step_token_budget, config.enable_chunked_prefill, replay
        )
        self.sampler = Sampler()
        self.async_scheduling = config.resolved_async_scheduling
        self.spec_stats: SpeculativeStats | None = None
        speculative = None
        if config.speculative_config is not None:
            self.spec_stats = SpeculativeStats()
            speculative = SpeculativeExecutor(self.runner, self.sampler, config.speculative_config)
        self.worker = DeviceWorker(self.runner, self.sampler, threaded=self.async_scheduling, speculative=speculative)
        self._inflight: InflightStep | None = None
        self.requests: dict[str, list[Sequence]] = {}
        hasher = getattr(model, "engram_hasher", None)  # V4.1: the Engram hash maps only its vocabulary
        self.checker = RequestChecker(tokenizer, model.config, self.max_model_len, hasher)
        # Overlap scheduling: steps handed over before the host read the running step's tokens, fed them on the device.
        self.steps_fed_on_device = 0
        self.last_step: StepStats | None = None
        self._grammar_compiler = None  # built on the first structured-output request
        # Start-up: every prefill kernel shape a prompt can reach compiled now, not during the first long prompt.
        self.warm_up = warm_up_kernels(self) if config.resolved_kernel_warmup else None

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, images: list | None = None) -> str:  # fmt: skip
        """Queue a request; validates it first (bad input raises ``ValueError`` and changes nothing).

        ``images`` (V4.1 with a vision tower): :class:`~dsinfer.images.inputs.ImageInput` placed on spans of
        the prompt (:func:`~dsinfer.images.inputs.expand_placeholders`); encoded when prefill reaches them."""
        request = self.checker.check(prompt, params, request_id, images, self.requests)
        params, prompt_ids, now = request.params, request.prompt_token_ids, time.monotonic()
        sequences = []
        for i in range(params.n):
            state = make_sampling_state(
                params, prompt_ids, self.tokenizer.eos_id, sample_index=i, constraint=self._constraint(params)
            )
            text = CompletionText(self.tokenizer, params)
            sequences.append(Sequence(request.request_id, i, list(prompt_ids), state, now, images=request.images,
                                      output_text=text))  # fmt: skip
        self.requests[request.request_id] = sequences
        for seq in sequences:
            self.scheduler.add(seq)
        return request.request_id

    def fork_request(self, source_id: str, params: SamplingParams | None = None,
                     request_id: str | None = None) -> str:  # fmt: skip
        """A new request that goes on from where running request ``source_id`` is: the same prompt and tokens so far,
        its caches copied on the device into a slot and blocks of its own (nothing shared, so every later step
        reads them as it would a separately prefilled sequence's), sampled with ``params``. The benchmarks fill
        long contexts this way (one prefill, then copies). Settles the step in flight first.

        With speculative decoding the drafter's state is part of the copied caches (V4's MTP window rings,
        V4.1's DSpark rings) and the clone takes the source's pending drafts.

        Refused with ``ValueError``: an unknown or finished source, one of several completions, one still
        prefilling, images, structured output, or no free slot or blocks."""
        self.settle()
        sources = self.requests.get(source_id, [])
        if len(sources) != 1 or sources[0].is_finished or sources[0].num_uncomputed != 1:
            raise ValueError(f"fork: {source_id!r} is not one running completion past its prefill")
        source = sources[0]
        if source.images:
            raise ValueError("fork: not of a request with images (their spans live outside the cache)")
        request = self.checker.check(source.prompt_token_ids, params, request_id, None, self.requests)
        if request.params.n != 1 or request.params.structured_output is not None:
            raise ValueError("fork: params must ask for one completion without structured output")
        state = make_sampling_state(request.params, request.prompt_token_ids, self.tokenizer.eos_id)
        clone = Sequence(request.request_id, 0, list(request.prompt_token_ids), state,
                         output_text=CompletionText(self.tokenizer, request.params))  # fmt: skip
        clone.output_token_ids.extend(source.output_token_ids)
        clone.draft_token_ids = list(source.draft_token_ids)
        self.scheduler.fork(source, clone)
        computed = len(clone.block_table)
        self.runner.cache.copy_sequence(source.slot, clone.slot, source.block_table[:computed], clone.block_table)
        clone.first_token_time = time.monotonic()
        self.requests[request.request_id] = [clone]
        return request.request_id

    def _constraint(self, params: SamplingParams):
        """A fresh grammar constraint for one sequence, when the request asks for structured output."""
        wanted = params.structured_output
        if wanted is None:
            return None
        if self._grammar_compiler is None:
            from dsinfer.sampling.structured_output import StructuredOutputCompiler  # xgrammar imports slowly

            self._grammar_compiler = StructuredOutputCompiler(self.tokenizer, vocab_size=self.model.config.vocab_size)
        return self._grammar_compiler.make_constraint(wanted, start_after_token=wanted.start_after_token)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its cache; unknown or finished ids are ignored."""
        self.finish(request_id, "abort")

    def finish(self, request_id: str, reason: str = "stop") -> None:
        """End a request its consumer completed, freeing its cache; its running completions end with ``reason``."""
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                seq.finish_reason = reason
                seq.finish_time = time.monotonic()
                self.scheduler.finish(seq)

    def finish_sequence(self, request_id: str, index: int) -> None:
        """End one completion of a request with ``stop`` (a stop string found by whoever makes its text); the
        request's other completions go on. Unknown ids, indices or finished completions are ignored."""
        sequences = self.requests.get(request_id, [])
        if index < len(sequences) and not sequences[index].is_finished:
            self.scheduler.finish(sequences[index])
            sequences[index].finish_reason = "stop"

    def has_unfinished_requests(self) -> bool:
        """Work is left: sequences waiting or running, or a step in flight whose tokens someone still wants."""
        inflight = self._inflight
        return self.scheduler.has_work() or (
            inflight is not None and any(not seq.is_finished for seq in inflight.sampled)
        )

    def unfinished_completions(self, request_id: str) -> int:
        return sum(not seq.is_finished for seq in self.requests.get(request_id, ()))

    def load(self) -> EngineLoad:
        scheduler, blocks = self.scheduler, self.blocks
        return EngineLoad(
            len(scheduler.waiting), len(scheduler.running), blocks.num_used, blocks.num_blocks,
            blocks.prefix_queries, blocks.prefix_hits, scheduler.num_preemptions, self.spec_stats,
            poll_offload_traffic(self.model),
        )  # fmt: skip

    def close(self) -> None:
        """Stop the device worker (waits for a step still running). The engine is unusable afterwards."""
        if self._inflight is not None:
            self._inflight.handle.result()
            self._inflight = None
        self.worker.close()

    def settle(self) -> list[RequestOutput]:
        """Finish the step in flight, if any, without launching another (overlap scheduling keeps one running
        between calls to :meth:`step`); returns what it produced. The engine is then at rest."""
        current, self._inflight = self._inflight, None
        if current is None:
            return []
        results = self._wait_for(current, launched_ahead=False)
        now = time.monotonic()
        touched, with_text = self._take_results(current, results, now)
        return self._finish_step(touched, with_text, now)

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; report every request that changed (new tokens or finished).

        Without ``async_scheduling`` each call schedules, runs and finishes one step (:meth:`_step_serial`).
        With it the device worker is already running the step launched by the previous call, and this call
        plans and launches the next one around it (:meth:`_step_overlapped`)."""
        return self._step_overlapped() if self.async_scheduling else self._step_serial()

    def _step_serial(self) -> list[RequestOutput]:
        """Schedule, run the step right here (the worker has no thread), then take its tokens and text."""
        timer = _StepTimer(overlapped=False)
        plan = self.scheduler.schedule()
        timer.scheduled()
        if not plan.scheduled:
            self.last_step = timer.stats(0)
            return []
        current = self._launch(plan.scheduled)
        results = current.handle.result()
        timer.ran()
        now = time.monotonic()
        touched, with_text = self._take_results(current, results, now)
        outputs = self._finish_step(touched, with_text, now)
        self.last_step = timer.stats(current.num_tokens)
        return outputs

    def _step_overlapped(self) -> list[RequestOutput]:
        """Plan step N+1 while step N runs on the device worker, and launch it at once when it can (every
        sequence it samples again needs only its planned output position: the worker copies their newest tokens
        on the device), else once step N's tokens are on the host; then turn step N's tokens into text."""
        timer = _StepTimer(overlapped=True)
        if self._inflight is None:  # nothing running: start the first step of a burst
            plan = self.scheduler.schedule()
            timer.scheduled()
            if not plan.scheduled:
                self.last_step = timer.stats(0)
                return []
            self._inflight = self._launch(plan.scheduled)
            timer.ran()
        current, self._inflight = self._inflight, None
        next_plan = self._plan_after(current)
        timer.scheduled()
        pending_rows = self._launch_ahead_rows(next_plan.scheduled, current)
        if pending_rows is not None:
            self._inflight = self._launch(next_plan.scheduled, pending_rows)
        timer.postprocessed()  # launching the next step counts as the host's own work
        results = self._wait_for(current, launched_ahead=pending_rows is not None)
        timer.ran()
        now = time.monotonic()
        touched, with_text = self._take_results(current, results, now)
        if pending_rows is not None:  # their newest tokens are on the host now: the blocks they fill can be hashed
            for item in next_plan.scheduled:
                self.blocks.register_computed(item.seq)
        else:
            live = [item for item in next_plan.scheduled if not item.seq.is_finished]
            if live:
                self._inflight = self._launch(live)
        outputs = self._finish_step(touched, with_text, now)
        self.last_step = timer.stats(current.num_tokens)
        return outputs

    def _plan_after(self, current: InflightStep) -> SchedulerOutput:
        """Schedule the step after ``current`` before its tokens exist: each sequence it samples counts one
        pending token, and one whose token in flight is its last by length gives its slot and blocks back."""
        for seq in current.sampled:
            if seq.is_finished:
                continue
            if self._reaches_length_limit(seq):
                self.scheduler.retire(seq)  # its slot and blocks can serve the next step already
            else:
                seq.num_pending_tokens = 1  # its token is being sampled: plan the step after it now
        return self.scheduler.schedule()

    def _wait_for(self, current: InflightStep, launched_ahead: bool) -> list:
        """``current``'s sample outputs; a step launched ahead of a failed one is waited for and dropped (the
        first error is the news)."""
        try:
            results = current.handle.result()
        except BaseException:
            if launched_ahead:
                ahead, self._inflight = self._inflight, None
                ahead.handle.exception()
            raise
        if launched_ahead:
            # Let the worker take the Python lock and launch the next step before this thread turns tokens into
            # text: otherwise the device would wait up to a lock switch interval (5 ms) for its next kernels.
            self._inflight.started.wait()
        return results

    def _take_results(self, current: InflightStep, results: list, now: float) -> tuple[list[Sequence], set[int]]:
        """Append a step's tokens and apply the stop rules that need no text; returns the sequences that took
        tokens and the ids of those whose text is already made (verified runs make it token by token)."""
        for seq in current.sampled:
            seq.num_pending_tokens = 0
        touched, with_text = [], set()
        for seq, result in zip(current.sampled, results, strict=True):
            if not seq.is_finished:  # an abort, or a stop string found while this step ran, ended it
                if isinstance(result, SpeculativeOutput):
                    if self._take_verified(seq, result, now):
                        with_text.add(id(seq))
                else:
                    self._append_token(seq, result, now)
                touched.append(seq)
        return touched, with_text

    def _finish_step(self, touched: list[Sequence], with_text: set[int], now: float) -> list[RequestOutput]:
        """Make the text of the step's tokens (stop strings may end sequences), then every changed request's
        output; requests whose completions have all ended are forgotten."""
        for seq in touched:
            if id(seq) not in with_text:
                self._update_text(seq, now)
        request_ids = dict.fromkeys(seq.request_id for seq in touched if seq.request_id in self.requests)
        outputs = [self._request_output(rid) for rid in request_ids]
        for rid in request_ids:
            if all(seq.is_finished for seq in self.requests[rid]):
                del self.requests[rid]
        return outputs

    def _reaches_length_limit(self, seq: Sequence) -> bool:
        """True when the token being sampled is the sequence's last by length (no step to plan after it)."""
        max_tokens = seq.sampling.params.max_tokens
        produced = len(seq.output_token_ids) + 1
        return (max_tokens is not None and produced >= max_tokens) or seq.num_tokens + 1 >= self.max_model_len

    def _launch_ahead_rows(self, scheduled: list[ScheduledSequence], current: InflightStep) -> dict[int, int] | None:
        """The rows of ``current``'s samples by sequence, when the planned step can run before the host reads
        them; None when it cannot (nothing planned, drafts, or a sequence whose sampling reads its output).

        Launched ahead, the step also runs sequences that ``current``'s tokens will end (a stop token): their
        row is wasted work, their slot and blocks are released afterwards as for an abort mid-step."""
        if not scheduled or any(item.num_draft_tokens for item in scheduled):
            return None
        rows = {id(seq): row for row, seq in enumerate(current.sampled)}
        for item in scheduled:
            seq = item.seq
            if id(seq) not in rows:
                continue  # not sampled by the running step: nothing of it changes meanwhile
            if not seq.num_pending_tokens or (item.completes_sequence and reads_output_so_far(seq.sampling)):
                return None
        return rows

    def _launch(self, scheduled: list[ScheduledSequence], pending_rows: dict[int, int] | None = None) -> InflightStep:
        """Hand a scheduled step to the device worker; the cache bookkeeping advances now.

        ``pending_rows`` (launching ahead of the running step's host read, see :meth:`step`): the sequences'
        newest tokens come from that step on the device, and their blocks are hashed once the tokens are known.
        """
        sampled = [item.seq for item in scheduled if item.completes_sequence]
        batch = self.runner.prepare(scheduled, pending_rows)  # reads the sequences now, before the scheduler moves on
        self.steps_fed_on_device += batch.pending_fill is not None
        output_positions = [len(seq.output_token_ids) + seq.num_pending_tokens for seq in sampled]
        for item in scheduled:
            item.seq.num_computed += item.num_new_tokens - item.num_draft_tokens  # drafts count once accepted
            if pending_rows is None:
                self.blocks.register_computed(item.seq)
        started = threading.Event() if pending_rows is not None else None
        handle = self.worker.submit(batch, [seq.sampling for seq in sampled], output_positions, started)
        return InflightStep(sampled, handle, sum(item.num_new_tokens for item in scheduled), started)

    def _append_token(self, seq: Sequence, result, now: float) -> None:
        """Take a sampled token: logprobs, then every stop rule that needs no text."""
        seq.output_token_ids.append(result.token_ids[0])
        if result.logprobs is not None:
            seq.output_logprobs.append(result.logprobs[0])
            seq.output_top_logprobs.append(result.top_logprobs[0] if result.top_logprobs else [])
        if seq.first_token_time is None:
            seq.first_token_time = now
        reason = finish_reason_after_token(seq, self.max_model_len)
        if reason is not None:
            self._finish(seq, reason, now)

    def _take_verified(self, seq: Sequence, result: SpeculativeOutput, now: float) -> bool:
        """Take a verified run of tokens one at a time (a stop rule inside the run ends it there), then keep the
        accepted drafts' cache, return the blocks past them and store the next drafts. True when the run's text
        is made here: only stop strings need it token by token (one may end the run early); otherwise the whole
        run is detokenized at once after the next step is launched (:meth:`_finish_step`)."""
        self.spec_stats.record(result.num_drafts, result.num_accepted)
        text_by_token = bool(seq.sampling.params.stop)
        for index, token in enumerate(result.token_ids):
            self._append_token(seq, SampleOutput(
                [token],
                None if result.logprobs is None else [result.logprobs[index]],
                None if result.top_logprobs is None else [result.top_logprobs[index]],
            ), now)  # fmt: skip
            if text_by_token:
                self._update_text(seq, now)
            if seq.is_finished:
                return text_by_token
        seq.num_computed += result.num_accepted
        self.blocks.register_computed(seq)
        self.blocks.trim(seq, seq.num_tokens)
        params, k = seq.sampling.params, self.config.speculative_config.num_speculative_tokens
        room = self.max_model_len - seq.num_tokens
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - len(seq.output_token_ids) - 1)
        seq.draft_token_ids = result.next_drafts[: max(0, min(k, room))]
        return text_by_token

    def _update_text(self, seq: Sequence, now: float) -> None:
        """Detokenize the new tokens and apply stop strings (which may end the sequence)."""
        if seq.output_text.update(seq.output_token_ids, seq.hide_last_token, seq.finish_reason):
            if seq.is_finished:
                seq.finish_reason = "stop"  # the stop string came with the last allowed token
            else:
                self._finish(seq, "stop", now)

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.finish_reason = reason
        seq.finish_time = now
        self.scheduler.finish(seq)

    def _request_output(self, request_id: str) -> RequestOutput:
        sequences = self.requests[request_id]
        completions = []
        for seq in sequences:
            wanted = seq.sampling.params.logprobs
            completions.append(completion_output(
                seq.index, seq.output_text.text, seq.output_token_ids, seq.finish_reason,
                seq.output_logprobs if wanted is not None else None, seq.output_top_logprobs if wanted else None,
            ))  # fmt: skip
        return request_output(request_id, sequences[0].prompt_token_ids, completions, _request_metrics(sequences))


def _request_metrics(sequences: list[Sequence]) -> RequestMetrics:
    """A request's timings over its completions: the first scheduled and first token, the last to finish."""
    finished_times = [s.finish_time for s in sequences]
    first_tokens = [s.first_token_time for s in sequences if s.first_token_time is not None]
    scheduled = [s.first_scheduled_time for s in sequences if s.first_scheduled_time is not None]
    return RequestMetrics(
        sequences[0].arrival_time,
        min(scheduled) if scheduled else None,
        min(first_tokens) if first_tokens else None,
        max(finished_times) if all(t is not None for t in finished_times) else None,
    )


class _StepTimer:
    """Splits a step's time on the engine thread into scheduling, waiting for the device, and the rest."""

    def __init__(self, overlapped: bool) -> None:
        self.overlapped = overlapped
        self.start = self.mark = time.perf_counter()
        self.schedule_s = self.model_s = 0.0

    def scheduled(self) -> None:
        """Time since the last mark was scheduling."""
        now = time.perf_counter()
        self.schedule_s += now - self.mark
        self.mark = now

    def ran(self) -> None:
        """Time since the last mark was the model (launching a step, or waiting for its results)."""
        now = time.perf_counter()
        self.model_s += now - self.mark
        self.mark = now

    def postprocessed(self) -> None:
        """Time since the last mark was the host's other work (the remainder of the step)."""
        self.mark = time.perf_counter()

    def stats(self, num_tokens: int) -> StepStats:
        postprocess_s = (time.perf_counter() - self.start) - self.schedule_s - self.model_s
        return StepStats(self.schedule_s, self.model_s, postprocess_s, num_tokens, self.overlapped)
