"""Overlap scheduling changes when the host works, never what the engine produces."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from engine_harness import random_prompts, run_all
from server_harness import metric_value, running_server

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(tiny_checkpoint, progress=False)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return Tokenizer.from_dir(tiny_checkpoint)


def _engine(model, tokenizer, async_scheduling: bool, **options) -> LLMEngine:
    defaults = {"max_num_seqs": 8, "max_num_batched_tokens": 48, "max_model_len": 160, "num_cache_blocks": 14}
    config = EngineConfig(**{**defaults, **options}, async_scheduling=async_scheduling)
    return LLMEngine(model, tokenizer, config)


def _workload(tokenizer) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = random_prompts(16, seed=21)
    params = []
    for i in range(16):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12, logprobs=2, n=2))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.7, seed=i, max_tokens=14, stop=[" the", "e"], min_tokens=2))
        else:
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=10, stop_token_ids=[17, 42, 99]))
    return prompts, params


def _summary(outputs):
    """Tokens, text and finish reasons of every completion (logprobs are compared separately)."""
    return [None if out is None else [(c.token_ids, c.text, c.finish_reason) for c in out.outputs] for out in outputs]


def _logprobs(outputs) -> list[float]:
    return [lp for out in outputs for c in out.outputs for lp in (c.logprobs or [])]


def test_overlapped_engine_produces_exactly_what_the_serial_engine_produces(model, tokenizer):
    prompts, params = _workload(tokenizer)
    serial = _engine(model, tokenizer, async_scheduling=False)
    overlapped = _engine(model, tokenizer, async_scheduling=True)
    serial_outputs = run_all(serial, prompts, params)
    overlapped_outputs = run_all(overlapped, prompts, params)
    expected, got = _summary(serial_outputs), _summary(overlapped_outputs)
    assert serial.scheduler.num_preemptions > 0 and overlapped.scheduler.num_preemptions > 0
    assert got == expected
    # Plan N+1 is made before step N's finished sequences are known, so its budget can split a prompt at
    # another point than the serial engine does; chunking moves fp32 logits by rounding only.
    serial_lp, overlapped_lp = _logprobs(serial_outputs), _logprobs(overlapped_outputs)
    assert len(serial_lp) == len(overlapped_lp) > 0
    assert max(abs(a - b) for a, b in zip(serial_lp, overlapped_lp, strict=True)) < 1e-4
    finish_reasons = {c[2] for out in expected for c in out}
    assert finish_reasons == {"length", "stop"}  # the workload exercises both ways of ending
    for engine in (serial, overlapped):
        assert engine.blocks.num_used == 0 and not engine.requests
        assert sorted(engine.scheduler.free_slots) == list(range(8))
        engine.close()


def test_abort_while_a_step_is_in_flight_frees_everything(model, tokenizer):
    prompts, params = _workload(tokenizer)
    engine = _engine(model, tokenizer, async_scheduling=True)
    outputs = run_all(engine, prompts[:6], params[:6], abort_after={3: "req-1", 5: "req-4"})
    assert outputs[1] is None and outputs[4] is None  # aborted requests report nothing more
    serial = _engine(model, tokenizer, async_scheduling=False)
    alone = _summary(run_all(serial, [prompts[0]], [params[0]]))
    assert _summary([outputs[0]]) == alone  # a greedy neighbour is untouched by the aborts
    assert engine.blocks.num_used == 0 and not engine.requests and not engine.has_unfinished_requests()
    engine.close()
    serial.close()


def test_next_step_is_scheduled_while_the_device_runs(model, tokenizer):
    """With overlap, the scheduler runs while the worker processes a step (forward and sampling); without, never."""
    for async_scheduling in (False, True):
        engine = _engine(model, tokenizer, async_scheduling=async_scheduling)
        running = threading.Event()
        seen_running = []
        run_step, schedule = engine.worker._run, engine.scheduler.schedule

        def slow_step(*args, run_step=run_step, running=running):
            running.set()
            try:
                time.sleep(0.01)  # a step long enough for the engine thread to get ahead
                return run_step(*args)
            finally:
                running.clear()

        def watched_schedule(schedule=schedule, running=running, seen_running=seen_running):
            seen_running.append(running.is_set())
            return schedule()

        engine.worker._run = slow_step
        engine.scheduler.schedule = watched_schedule
        run_all(engine, random_prompts(4, seed=5), [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 4)
        engine.close()
        assert any(seen_running) is async_scheduling
        if async_scheduling:
            assert sum(seen_running) >= 5  # every decode step was planned while the step before it ran


def test_engine_errors_surface_to_the_caller_and_close_still_works(model, tokenizer):
    engine = _engine(model, tokenizer, async_scheduling=True)

    def broken(batch):
        raise RuntimeError("device fell over")

    engine.runner.execute = broken
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="device fell over"):
        for _ in range(3):
            engine.step()
    engine.close()


def test_two_hundred_overlapped_requests_return_every_block(model, tokenizer):
    engine = _engine(model, tokenizer, async_scheduling=True, num_cache_blocks=30, max_num_seqs=16,
                     max_num_batched_tokens=128)  # fmt: skip
    prompts = random_prompts(200, seed=4)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=1 + i % 5, stop_token_ids=[7]) for i in range(200)]
    outputs = run_all(engine, prompts, params)
    assert all(o is not None and o.finished for o in outputs)
    assert engine.blocks.num_used == 0 and not engine.requests
    assert sorted(engine.scheduler.free_slots) == list(range(16))
    engine.close()


def test_overlapped_prefix_cache_hit_equals_a_miss(model, tokenizer):
    shared = random_prompts(1, seed=3)[0] * 2
    prompts = [shared[:140] + [7, 8, 9], shared[:140] + [10], shared[:140] + [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cold = _engine(model, tokenizer, async_scheduling=False, enable_prefix_caching=False, max_model_len=200,
                   num_cache_blocks=None)  # fmt: skip
    expected = [out.outputs[0].token_ids for out in run_all(cold, prompts, [params] * 3)]
    warm = _engine(model, tokenizer, async_scheduling=True, max_model_len=200, num_cache_blocks=None)
    got = [run_all(warm, [prompt], [params])[0].outputs[0].token_ids for prompt in prompts]
    assert warm.blocks.prefix_hits > 0 and got == expected
    assert warm.blocks.num_used == 0
    cold.close()
    warm.close()


def test_server_with_overlap_frees_dropped_streams(tiny_checkpoint):
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024, async_scheduling=True)
    with running_server(tiny_checkpoint, config) as (base, engine):
        assert engine.engine.async_scheduling

        def drop_midway():
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 300, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{base}/v1/completions", timeout=60, json=body) as response:
                for count, _line in enumerate(response.iter_lines()):
                    if count >= 3:
                        return

        threads = [threading.Thread(target=drop_midway) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        done = client.completions.create(model="tiny", prompt="count", max_tokens=5, temperature=0)
        assert done.choices[0].finish_reason == "length"
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and metric_value(base, "dsinfer:kv_cache_blocks_in_use") > 0:
            time.sleep(0.05)
        assert metric_value(base, "dsinfer:kv_cache_blocks_in_use") == 0


@pytest.mark.parametrize("penalised", [False, True])
def test_steps_launch_ahead_of_the_host_read_unless_sampling_reads_the_output(model, tokenizer, penalised):
    """Greedy and seeded rows need only their planned output position: the next step is handed over before the
    host reads the running one's tokens (the worker copies them on the device) and the tokens equal serial
    decoding's. A penalty reads the output so far: those steps wait for the host, and still equal serial."""
    prompts = random_prompts(6, seed=9)
    extra = {"repetition_penalty": 1.3, "presence_penalty": 0.4} if penalised else {}
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **extra) for _ in range(3)]
    params += [SamplingParams(temperature=0.8, seed=i, max_tokens=10, stop_token_ids=[7], **extra) for i in range(3)]
    serial = _engine(model, tokenizer, async_scheduling=False)
    overlapped = _engine(model, tokenizer, async_scheduling=True)
    expected = _summary(run_all(serial, prompts, params))
    assert _summary(run_all(overlapped, prompts, params)) == expected
    if penalised:
        assert overlapped.steps_fed_on_device == 0
    else:
        assert overlapped.steps_fed_on_device > 5
    assert serial.steps_fed_on_device == 0
    for engine in (serial, overlapped):
        assert engine.blocks.num_used == 0 and not engine.requests
        engine.close()


def test_v41_steps_fed_on_device_give_serial_tokens(tiny_v41_checkpoint):
    """V4.1 (Engram history, FP8 / FP4 caches) with the next step launched ahead of the host read: the tokens of
    serial decoding, greedy and seeded (prompts short enough never to be split differently, since V4.1's
    trained-in rounding can turn another chunking into another token)."""
    model = load_model(tiny_v41_checkpoint, progress=False)
    tokenizer = Tokenizer.from_dir(tiny_v41_checkpoint)
    shared = random_prompts(1, seed=5)[0][:40]
    prompts = [shared + p[:8] for p in random_prompts(5, seed=6)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) for _ in range(3)]
    params += [SamplingParams(temperature=0.9, seed=i, max_tokens=10, ignore_eos=True) for i in range(2)]
    options = {"max_num_batched_tokens": 512, "max_model_len": 128, "num_cache_blocks": 40}
    serial = _engine(model, tokenizer, async_scheduling=False, **options)
    overlapped = _engine(model, tokenizer, async_scheduling=True, **options)
    expected = _summary(run_all(serial, prompts, params))
    assert _summary(run_all(overlapped, prompts, params)) == expected
    assert overlapped.steps_fed_on_device > 5
    for engine in (serial, overlapped):
        assert engine.blocks.num_used == 0 and not engine.requests
        engine.close()


def test_min_tokens_does_not_stop_steps_being_launched_ahead(model, tokenizer):
    """``min_tokens`` masks stop tokens by the output's length alone, which a step planned ahead knows: the
    engine keeps launching ahead (the benchmarks' min_tokens = max_tokens runs) and the tokens are the serial
    engine's, eos kept out until min_tokens."""
    prompts = random_prompts(4, seed=8)
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=10, stop_token_ids=[5, 6, 7])
    results = []
    for overlap in (False, True):
        engine = _engine(model, tokenizer, overlap)
        results.append(_summary(run_all(engine, prompts, [params] * 4)))
        if overlap:
            assert engine.steps_fed_on_device > 5  # decode steps went ahead of the host read (0 before)
    assert results[0] == results[1]
    assert all(len(c[0]) == 10 for out in results[1] for c in out)
