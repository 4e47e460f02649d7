"""``benchmarks/spec_speedup.py``'s accounting: the closed loop counts the engine steps it ran, and a drafting
engine whose verify steps replay graphs gets a phase clock that times every such step (none for the others)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from engine_harness import random_prompts

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from spec_speedup import serve_counted, start_phase_clocks  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(checkpoint, speculative: dict | None) -> LLMEngine:
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=160, cuda_graph_sizes=(1, 2),
                          speculative_config=speculative)  # fmt: skip
    return LLMEngine(load_model(checkpoint, progress=False), Tokenizer.from_dir(checkpoint), config)


def test_steps_are_counted_and_only_graphed_drafting_engines_get_a_clock(tiny_checkpoint):
    prompts = random_prompts(3, seed=2)
    engines = {"plain": _engine(tiny_checkpoint, None),
               "mtp:2": _engine(tiny_checkpoint, {"method": "mtp", "num_speculative_tokens": 2})}  # fmt: skip
    clocks = start_phase_clocks(engines)
    assert set(clocks) == {"mtp:2"}
    seconds, replies, steps = serve_counted(engines["plain"], prompts, 2, 12)
    assert seconds > 0 and len(replies) == 3 and all(1 <= len(reply) <= 12 for reply in replies)
    assert sum(map(len, steps.values())) >= max(map(len, replies))  # one token a sequence and step, at most
    assert len(steps["admit"]) == 2  # two streams: the first two requests join at once, the third when one ends
    executor = engines["mtp:2"].worker.speculative
    before = executor.graphed_steps + executor.split_steps  # a split step replays the graphs for its decodes
    _, drafted, spec_steps = serve_counted(engines["mtp:2"], prompts, 2, 12)
    assert drafted == replies  # greedy: drafting changes no token
    replayed = executor.graphed_steps + executor.split_steps - before
    assert sum(map(len, spec_steps.values())) >= 1 and len(clocks["mtp:2"].laps) == replayed > 0
