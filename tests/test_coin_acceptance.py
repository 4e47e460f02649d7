"""The coin-acceptance benchmark device: drafts accepted at the asked rate, seeded, and out of reach of serving.

``dsinfer.bench.coin_acceptance`` stands in for judging so random weights can be timed at the official
accounting's acceptance (each draft accepted with probability 0.75). It must accept at that rate, replay from its
seed, still run the rollback (every block back in the pool at the end), and no option of ``dsinfer serve``, ``LLM`` or
the engine may turn it on.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
from engine_harness import random_prompts, run_all

import dsinfer
from dsinfer.bench.coin_acceptance import CoinJudge, accept_by_coin
from dsinfer.cli import build_parser
from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SPEC = {"method": "mtp", "num_speculative_tokens": 3}


def test_the_coin_accepts_each_draft_at_its_rate_and_replays_from_its_seed():
    drafts = [[5, 6, 7], [8, 9], [], [1, 2, 3]] * 500
    verdicts = CoinJudge(0.75, seed=3)(drafts)
    accepted = sum(a for a, _ in verdicts)
    assert accepted / sum(len(d) for d in drafts) == pytest.approx(0.75, abs=0.02)
    assert all(0 <= a <= len(d) for (a, _), d in zip(verdicts, drafts, strict=True))
    # The token after the accepted drafts is the next draft (or the last one when all were accepted).
    assert all(t == (d[a] if a < len(d) else d[-1]) for (a, t), d in zip(verdicts, drafts, strict=True) if d)
    assert CoinJudge(0.75, seed=3)(drafts) == verdicts and CoinJudge(0.75, seed=4)(drafts) != verdicts
    assert all(a == 0 for a, _ in CoinJudge(0.0)(drafts))
    assert all(a == len(d) for (a, _), d in zip(CoinJudge(1.0)(drafts), drafts, strict=True))
    with pytest.raises(ValueError, match="rate"):
        CoinJudge(1.5)


@pytest.mark.parametrize("buckets", [None, (1, 2, 4)], ids=["eager", "buckets"])
def test_an_engine_with_the_coin_accepts_at_the_rate_and_frees_every_block(tiny_v4_model, tiny_v4_tokenizer,
                                                                           buckets):  # fmt: skip
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=200, speculative_config=SPEC,
                          cuda_graph_sizes=buckets)  # fmt: skip
    engine = LLMEngine(tiny_v4_model, tiny_v4_tokenizer, config)
    accept_by_coin(engine, 0.75, seed=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = run_all(engine, random_prompts(8, seed=4, low=5, high=40), params)
    assert all(len(out.outputs[0].token_ids) == 24 for out in outputs)
    stats = engine.spec_stats
    assert stats.num_draft_tokens > 100 and stats.acceptance_rate == pytest.approx(0.75, abs=0.1)
    assert engine.blocks.num_used == 0
    if buckets:
        assert engine.worker.speculative.graphed_steps > 0


def test_no_engine_or_server_option_turns_the_coin_on(tiny_v4_model, tiny_v4_tokenizer):
    assert not [f.name for f in dataclasses.fields(EngineConfig) if "coin" in f.name or "judge" in f.name]
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("serve", "generate", "chat"):
        if name in commands.choices:
            options = [o for a in commands.choices[name]._actions for o in a.option_strings]
            assert options and not [o for o in options if "coin" in o or "judge" in o], name
    engine = LLMEngine(tiny_v4_model, tiny_v4_tokenizer,
                       EngineConfig(max_model_len=64, speculative_config=SPEC))  # fmt: skip
    assert engine.worker.speculative.judge_override is None
    # The one place that sets the stand-in is the benchmark module.
    root = Path(dsinfer.__file__).parent
    setters = [path.relative_to(root).as_posix() for path in root.rglob("*.py")
               if re.search(r"\.judge_override\s*=", path.read_text())]  # fmt: skip
    assert setters == ["bench/coin_acceptance.py"]
