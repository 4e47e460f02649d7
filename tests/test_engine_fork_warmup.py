"""A forked request continues exactly as its source (its caches are copies, not shared), and the start-up kernel
warm-up leaves the engine as a fresh one: both checked on the tiny V4 and V4.1 models on the CPU."""

from __future__ import annotations

import pytest
from engine_harness import random_prompts

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.engine.warmup import ODD_TAIL, warm_up_positions
from dsinfer.models.loader import load_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)


@pytest.fixture(scope="module", params=["v4", "v41"])
def served(request, tiny_checkpoint, tiny_v41_checkpoint):
    directory = tiny_checkpoint if request.param == "v4" else tiny_v41_checkpoint
    return load_model(directory, progress=False), Tokenizer.from_dir(directory)


def _engine(served, **options) -> LLMEngine:
    model, tokenizer = served
    defaults = {"max_num_seqs": 4, "max_num_batched_tokens": 40, "max_model_len": 200, "num_cache_blocks": 24}
    return LLMEngine(model, tokenizer, EngineConfig(**{**defaults, **options}))


def _tokens(engine: LLMEngine, request_id: str) -> list[int]:
    return engine.requests[request_id][0].output_token_ids


def _decode_until(engine: LLMEngine, request_ids: list[str], count: int) -> None:
    while min(len(_tokens(engine, rid)) for rid in request_ids) < count:
        engine.step()
    engine.settle()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_fork_continues_as_the_source_and_as_a_fresh_prefill(served, async_scheduling):
    prompt = random_prompts(1, seed=5, high=100)[0] * 3  # 3 x the prompt: several chunks and blocks
    alone = _engine(served, async_scheduling=async_scheduling)
    rid = alone.add_request(prompt, GREEDY)
    _decode_until(alone, [rid], 12)
    expected = _tokens(alone, rid)[:12]

    engine = _engine(served, async_scheduling=async_scheduling)
    source = engine.add_request(prompt, GREEDY)
    _decode_until(engine, [source], 3)
    clones = [engine.fork_request(source, GREEDY) for _ in range(2)]
    owned = [set(engine.requests[r][0].block_table) for r in [source, *clones]]
    assert not (owned[0] & owned[1]) and not (owned[0] & owned[2]) and not (owned[1] & owned[2])
    _decode_until(engine, [source, *clones], 12)
    for request_id in [source, *clones]:
        assert _tokens(engine, request_id)[:12] == expected


def test_fork_refuses_what_it_cannot_copy(served):
    engine = _engine(served)
    with pytest.raises(ValueError, match="not one running completion"):
        engine.fork_request("no-such-request", GREEDY)
    waiting = engine.add_request(random_prompts(1, seed=2)[0], GREEDY)
    with pytest.raises(ValueError, match="not one running completion"):
        engine.fork_request(waiting, GREEDY)  # nothing prefilled yet
    _decode_until(engine, [waiting], 1)
    with pytest.raises(ValueError, match="one completion"):
        engine.fork_request(waiting, SamplingParams(temperature=0.5, n=2, max_tokens=4))


def test_fork_without_room_names_what_is_missing(served):
    engine = _engine(served, max_num_seqs=1)
    rid = engine.add_request(random_prompts(1, seed=3)[0], GREEDY)
    _decode_until(engine, [rid], 1)
    with pytest.raises(ValueError, match="free state slot"):
        engine.fork_request(rid, GREEDY)


def test_warm_up_positions_cover_every_power_of_two_bucket():
    chunks = warm_up_positions(16384, 131073)
    at_zero = sorted(n for start, n in chunks if start == 0)
    powers = [2**k for k in range(15)]
    assert at_zero == sorted({1, *powers, *(p - 1 for p in powers if p > 1)} - {0})
    assert [c for c in chunks if c[0]] == [
        (16384, 16384), (32768, 16384), (65536, 16384), (131072 - ODD_TAIL, ODD_TAIL)
    ]  # fmt: skip
    assert warm_up_positions(512, 100) == [(0, n) for n in (99, 64, 63, 32, 31, 16, 15, 8, 7, 4, 3, 2, 1)]


def test_warm_up_leaves_a_fresh_engine(served):
    cold = _engine(served)
    warm = _engine(served, kernel_warmup=True)
    assert cold.warm_up is None and warm.warm_up["chunks"] == len(warm_up_positions(40, 200))
    assert warm.blocks.num_used == 0 and not warm.blocks.hash_to_block and not warm.requests
    assert warm.scheduler.num_preemptions == 0 and warm.blocks.prefix_queries == 0
    prompts = random_prompts(3, seed=9)
    results = []
    for engine in (cold, warm):
        ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out.outputs[0].token_ids
        results.append([done[i] for i in ids])
    assert results[0] == results[1]


def test_a_fork_under_speculation_drafts_as_its_source():
    """The embedded default's DSpark drafts are accepted (its rings hold real state): a fork taken mid-run
    accepts exactly what its source accepts, step for step, so the drafter's rings and pending drafts were copied;
    and both continue with plain decoding's tokens."""
    from dsinfer.chat.format import ChatFormat
    from dsinfer.models.tiny import default_model_dir
    from dsinfer.training import corpus
    from dsinfer.training.render import SampleRenderer

    directory = default_model_dir()
    served = load_model(directory, progress=False), Tokenizer.from_dir(directory)
    renderer = SampleRenderer(ChatFormat(served[1], "v41", "default"))
    prompt = renderer.prompt_ids(corpus.held_out("tools", 1)[0])
    options = {"max_model_len": 1024, "max_num_batched_tokens": 1024, "block_tokens": 64, "num_cache_blocks": 64}
    spec = {"method": "dspark", "num_speculative_tokens": 3}
    plain = _engine(served, **options)
    expected = plain.add_request(prompt, GREEDY)
    _decode_until(plain, [expected], 40)
    accepted = []
    for forks in (0, 1):
        engine = _engine(served, **options, speculative_config=spec)
        source = engine.add_request(prompt, GREEDY)
        _decode_until(engine, [source], 4)
        ids = [source] + [engine.fork_request(source, GREEDY) for _ in range(forks)]
        before = engine.spec_stats.num_accepted_tokens
        for _ in range(8):
            engine.step()
        accepted.append(engine.spec_stats.num_accepted_tokens - before)
        for request_id in ids:
            produced = _tokens(engine, request_id)
            assert produced == _tokens(plain, expected)[: len(produced)]
    assert accepted[0] > 4 and accepted[1] == 2 * accepted[0]
