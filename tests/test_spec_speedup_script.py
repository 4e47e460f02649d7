"""``benchmarks/spec_speedup.py``'s accounting: the closed loop counts the engine steps it ran, and a drafting
engine whose verify steps replay graphs gets a phase clock that times every such step (none for the others); the
whole run on the CPU writes its rows, profiles included."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from engine_harness import random_prompts

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import spec_speedup  # noqa: E402
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


def test_the_whole_run_writes_a_row_per_mode_with_its_steps_and_profile(tmp_path):
    out = tmp_path / "rows.json"
    spec_speedup.main(["--device", "cpu", "--streams", "1", "--modes", "plain", "dspark:2", "--chats", "1",
                       "--max-tokens", "2", "--rounds", "1", "--warmup-rounds", "0", "--profile-chats", "1",
                       "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [row["mode"] for row in rows] == ["plain", "dspark:2"] and rows[0]["speedup"] == 1.0
    for row in rows:
        assert row["replies_equal_to_first_mode"] == "12/12"  # greedy: drafting changes no token
        kinds = row["step_kinds"]
        assert kinds["admit"]["steps"] == 12  # one stream: each chat joins alone and prefills in its own step
        assert row["profile"]["steps"] >= 2 and row["profile"]["per_step"]["kernels"] > 0
        assert row["profile"]["step_kinds"]["admit"]["steps"] == 1  # the profiled chat
        admit, decode = row["profile"]["by_kind"]["admit"], row["profile"]["by_kind"]["decode"]
        assert admit["steps"] == 1 and decode["steps"] == row["profile"]["step_kinds"]["decode"]["steps"]
        assert admit["kernels"] + decode["kernels"] == row["profile"]["kernels"]
        assert admit["per_step"]["kernels"] > decode["per_step"]["kernels"] > 0  # a prefill runs more ops
    assert rows[1]["tau"] >= 1.0 and rows[0]["tau"] is None


def test_a_profile_records_the_graphs_again_once_at_its_first_session(tiny_checkpoint, monkeypatch):
    """CUPTI sees a CUDA graph's replays only where the graph was instantiated after profiling began: the first
    session records the engine's graphs again (decode and speculative, on its worker), and no later one does."""
    engine = _engine(tiny_checkpoint, {"method": "mtp", "num_speculative_tokens": 2})
    recorded = []
    monkeypatch.setattr(spec_speedup, "recapture_graphs", recorded.append)
    profile = spec_speedup.profile_mode(engine, random_prompts(2, seed=3), 1, 3)
    assert recorded == [engine]
    assert profile["steps"] >= 3  # two admissions and at least one decode step, each its own session
