"""On CUDA, speculative decoding under batching gives plain decoding's greedy tokens (graph buckets, padding rows,
sequences joining and leaving, the side stream), and graphs captured before a larger step keep reading what they
read at capture.

The scenario is ``benchmarks/spec_speedup.py --streams 1 16 --modes plain dspark:3 --chats 2 --max-tokens 128``:
the embedded default's 24 held-out chats, 16 in flight (a finished request's place goes to the next prompt),
greedy, every engine built on one model that has already served (as the benchmark builds them), V4.1 prompts
prefilled ``exact`` in every engine. With the activation rounding off any differing reply is a fault; with it
on (the shipped model) a last-bit difference between kernels can also cross a rounding boundary. Then the same
check for MTP on the tiny V4 model. Skipped without a GPU.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
from engine_harness import random_prompts

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import default_model_dir
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from spec_speedup import held_out_prompts, serve  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DSPARK = {"method": "dspark", "num_speculative_tokens": 3}
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def _replies(model, tokenizer, prompts, streams: int, speculative: dict | None, max_tokens: int) -> list[list[int]]:
    config = EngineConfig(max_num_seqs=streams, max_model_len=2048, max_num_batched_tokens=2048, device="cuda",
                          dtype="float32", cache_memory_bytes=1 << 30, speculative_config=speculative,
                          v41_prefill="exact")  # fmt: skip
    engine = LLMEngine(model, tokenizer, config)
    try:
        _, replies = serve(engine, prompts, streams, max_tokens)
    finally:
        engine.close()
    del engine
    gc.collect()
    return replies


def _differing(replies: list[list[int]], reference: list[list[int]]) -> list[int]:
    return [i for i, (a, b) in enumerate(zip(replies, reference, strict=True)) if a != b]


@pytest.mark.parametrize("rounding", [False, True], ids=["rounding-off", "rounding-on"])
def test_dspark_at_16_streams_gives_plain_decodings_replies(rounding):
    directory = str(default_model_dir())
    model = load_model(directory, dtype=torch.float32, device="cuda", progress=False)
    model.set_fake_quantization(rounding)
    tokenizer = Tokenizer.from_dir(directory)
    prompts = held_out_prompts(tokenizer, 2)
    alone = _replies(model, tokenizer, prompts, 1, None, 128)  # the model serves first, as in the benchmark
    plain = _replies(model, tokenizer, prompts, 16, None, 128)
    drafted = _replies(model, tokenizer, prompts, 16, DSPARK, 128)
    assert not _differing(plain, alone), f"plain decoding at 16 streams changed replies {_differing(plain, alone)}"
    assert not _differing(drafted, plain), f"DSpark at 16 streams changed replies {_differing(drafted, plain)}"


def test_mtp_at_16_streams_gives_plain_decodings_replies(tiny_checkpoint, tiny_v4_tokenizer):
    model = load_model(str(tiny_checkpoint), dtype=torch.float32, device="cuda", progress=False)
    prompts = random_prompts(24, seed=46, low=5, high=300)
    alone = _replies(model, tiny_v4_tokenizer, prompts, 1, None, 64)
    plain = _replies(model, tiny_v4_tokenizer, prompts, 16, None, 64)
    drafted = _replies(model, tiny_v4_tokenizer, prompts, 16, MTP, 64)
    assert not _differing(plain, alone), f"plain decoding at 16 streams changed replies {_differing(plain, alone)}"
    assert not _differing(drafted, plain), f"MTP at 16 streams changed replies {_differing(drafted, plain)}"


@pytest.mark.parametrize("speculative", [None, DSPARK], ids=["decode-graphs", "dspark-graphs"])
def test_graphs_captured_before_a_larger_step_replay_what_eager_steps_compute(speculative):
    """A model that has run a 16-row step eagerly (its kept first-mix block is then 16 rows of the main stream's
    memory) gets a graphed engine, whose buckets (up to 4 sequences of K + 1 rows) all fit that block; a long
    prompt then grows the block and the freed memory is scribbled over. The graphed replies must equal those of
    an eager engine on a model with the same history."""
    directory = str(default_model_dir())
    tokenizer = Tokenizer.from_dir(directory)
    prompts = held_out_prompts(tokenizer, 1)
    short, long = min(prompts, key=len), max(prompts, key=len)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def run(enforce_eager: bool) -> list[list[int]]:
        model = load_model(directory, dtype=torch.float32, device="cuda", progress=False)
        model.embed_streams(torch.zeros(16, dtype=torch.long, device="cuda"))  # an earlier eager step's block
        config = EngineConfig(max_num_seqs=4, max_model_len=1024, device="cuda", dtype="float32",
                              cache_memory_bytes=1 << 28, speculative_config=speculative, enforce_eager=enforce_eager,
                              v41_prefill="exact")  # fmt: skip
        engine = LLMEngine(model, tokenizer, config)
        try:
            engine.add_request(long, SamplingParams(temperature=0, max_tokens=1))  # grows the kept block
            while engine.has_unfinished_requests():
                engine.step()
            scribble = [torch.full((128,), -3.0e4, device="cuda") for _ in range(4096)]
            del scribble  # freed small blocks now hold a value no one-hot row has
            replies = {engine.add_request(prompt, params): None for prompt in (short, long)}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        replies[out.request_id] = out.outputs[0].token_ids
            return list(replies.values())
        finally:
            engine.close()

    assert run(enforce_eager=False) == run(enforce_eager=True)


@pytest.mark.parametrize("speculative", [None, MTP], ids=["decode-graphs", "mtp-graphs"])
def test_graphs_recorded_again_mid_reply_keep_the_replies(tiny_checkpoint, tiny_v4_tokenizer, speculative):
    """A profile records the engine's graphs again between two steps (``sweep_timing.recapture_graphs``), with
    sequences half-way through their replies: every bucket is recorded anew, on padding rows only, and the replies
    are those of the same engine left alone."""
    from dsinfer.bench.sweep_timing import recapture_graphs

    model = load_model(str(tiny_checkpoint), dtype=torch.float32, device="cuda", progress=False)
    prompts = random_prompts(4, seed=47, low=5, high=300)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    config = EngineConfig(max_num_seqs=4, max_model_len=512, device="cuda", dtype="float32",
                          cache_memory_bytes=1 << 28, speculative_config=speculative)  # fmt: skip
    engine = LLMEngine(model, tiny_v4_tokenizer, config)

    def serve(recapture_after: int | None) -> list[list[int]]:
        replies = {engine.add_request(prompt, params): None for prompt in prompts}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    replies[out.request_id] = out.outputs[0].token_ids
            steps += 1
            if steps == recapture_after:
                recapture_graphs(engine)
        return list(replies.values())

    try:
        alone = serve(None)
        executor = engine.worker.speculative
        graphs = engine.runner.decode_graphs if executor is None else executor.graphs
        assert graphs is not None
        first_recorded = dict(graphs.graphs)  # held, so a new graph cannot reuse an old one's identity
        recorded_again = serve(6)
        assert len(graphs.graphs) == len(graphs.sizes)
        assert all(graphs.graphs[size][0] is not old[0] for size, old in first_recorded.items())  # every bucket anew
    finally:
        engine.close()
    assert recorded_again == alone
