"""A benchmark's split of graphed speculative steps into the verify and the draft replay (``--time-spec-phases``):
one lap a step the graphs serve, none for the others, nothing recorded once the clock is off."""

from __future__ import annotations

import pytest
from engine_harness import random_prompts

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.speculative.phase_clock import PhaseClock
from dsinfer.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_clock_times_each_graphed_step_and_stops_when_taken_off(tiny_checkpoint):
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=160, cuda_graph_sizes=(1, 2),
                          speculative_config={"method": "mtp", "num_speculative_tokens": 2})  # fmt: skip
    engine = LLMEngine(load_model(tiny_checkpoint, progress=False), Tokenizer.from_dir(tiny_checkpoint), config)
    executor = engine.worker.speculative
    for prompt in random_prompts(2, seed=4):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()  # the prefill: no graphed step
    clock = executor.graphs.start_phase_clock()
    graphed = executor.graphed_steps + executor.split_steps  # a split step replays the graphs for its decodes
    for _ in range(5):
        engine.step()
    timed = executor.graphed_steps + executor.split_steps - graphed
    assert timed >= 3 and len(clock.laps) == timed
    assert all(verify > 0 and draft > 0 for verify, draft in clock.laps)
    medians = clock.medians()
    assert medians["steps"] == timed and medians["verify_ms"] > 0 and medians["draft_ms"] > 0
    executor.graphs.phase_clock = None
    engine.step()
    assert len(clock.laps) == timed


def test_a_step_without_all_three_marks_is_no_lap():
    import torch

    clock = PhaseClock(torch.device("cpu"))
    clock.mark()
    clock.mark()
    clock.close_step()
    assert clock.laps == [] and clock.medians() is None
    for _ in range(3):
        clock.mark()
    clock.close_step()
    assert len(clock.laps) == 1 and clock.medians()["steps"] == 1
