"""Speculative steps in static-shape buckets (the CUDA-graph path, run eagerly on the CPU) give plain decoding's
tokens, leave the caches as a run that never drafted, and read nothing on the host inside the replayed region.

Engines here get ``cuda_graph_sizes`` (1, 2, 4): three sequences run in bucket 4 with one padding row, and the
oracle drafter of tests/test_spec_decode.py (plain decoding's continuation with one wrong token at a moving
place) makes every acceptance length and rollback point come up. Sequences near their ``max_tokens`` carry fewer
than K drafts: their filler drafts run and are always rolled back.
"""

from __future__ import annotations

import pytest
import torch
from engine_harness import compare_caches_in_lockstep, random_prompts, run_all, use_oracle_drafts
from test_forward_host_reads import RefuseHostReads, _dense_experts, _use_gathered_moe
from test_spec_decode import _slot_state as v4_slot_state
from test_spec_dspark import _slot_state as v41_slot_state

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.models.loader import load_model
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import Tokenizer

BASE = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 160}
BUCKETS = {"cuda_graph_sizes": (1, 2, 4)}
GREEDY = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def v41_model(tiny_v41_checkpoint):
    # Fake quantization off: a bucket rounds in another order than an eager step (see tests/test_engine_v41.py).
    return load_model(tiny_v41_checkpoint, progress=False).set_fake_quantization(False)


@pytest.fixture(scope="module")
def v41_tokenizer(tiny_v41_checkpoint):
    return Tokenizer.from_dir(tiny_v41_checkpoint)


def _engine(model, tokenizer, spec: dict | None = None, **options) -> LLMEngine:
    return LLMEngine(model, tokenizer, EngineConfig(**{**BASE, **options}, speculative_config=spec))


def _record_buckets(engine: LLMEngine) -> list[tuple[int, int, bool]]:
    """(sequences, bucket, filler drafts run) of every step the graphs serve."""
    graphs, calls = engine.worker.speculative.graphs, []
    prepare = graphs.prepare

    def recording(step):
        run = prepare(step)
        calls.append((len(step.spans), run.size, run.judged_rows is not None))
        return run

    graphs.prepare = recording
    return calls


def _check_graphed_run_matches_plain(model, tokenizer, spec: dict, options: dict | None = None) -> None:
    options = options or {}
    prompts = random_prompts(3, seed=2, low=20, high=45)
    # A greedy request with a repetition penalty is judged on its own (one row after the other) from the bucket.
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=9, repetition_penalty=1.3, ignore_eos=True), GREEDY]
    plain = [out.outputs[0].token_ids for out in run_all(_engine(model, tokenizer, **options), prompts, params)]
    engine = _engine(model, tokenizer, spec, **BUCKETS, **options)
    assert engine.runner.decode_graphs is None and engine.worker.speculative.graphs.sizes == (1, 2, 4)
    calls = _record_buckets(engine)
    use_oracle_drafts(engine, {f"req-{i}": tokens for i, tokens in enumerate(plain)})
    assert [out.outputs[0].token_ids for out in run_all(engine, prompts, params)] == plain
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert (3, 4, False) in calls  # three sequences, one padding row
    assert any(filler for _, _, filler in calls)  # sequences with fewer drafts than K
    assert {size for _, size, _ in calls} >= {1, 4}
    assert engine.blocks.num_used == 0


@pytest.mark.parametrize("k", [1, 3])
def test_v4_mtp_steps_in_buckets_give_plain_decodings_tokens(tiny_v4_model, tiny_v4_tokenizer, k):
    _check_graphed_run_matches_plain(tiny_v4_model, tiny_v4_tokenizer, {"method": "mtp", "num_speculative_tokens": k})


def test_v41_dspark_steps_in_buckets_give_plain_decodings_tokens(v41_model, v41_tokenizer):
    spec = {"method": "dspark", "num_speculative_tokens": 3}
    _check_graphed_run_matches_plain(v41_model, v41_tokenizer, spec, {"num_cache_blocks": 64, "block_tokens": 8})


def test_v41_dspark_with_a_confidence_threshold_runs_its_ragged_drafts_in_buckets(v41_model, v41_tokenizer):
    """A threshold verifies a different number of drafts per sequence; the bucket runs them all at width K + 1."""
    prompts = random_prompts(3, seed=6, low=10, high=30)
    options = {"num_cache_blocks": 64, "block_tokens": 8}
    plain = [o.outputs[0].token_ids for o in run_all(_engine(v41_model, v41_tokenizer, **options), prompts, GREEDY)]
    spec = {"method": "dspark", "num_speculative_tokens": 3, "confidence_threshold": 0.5}
    engine = _engine(v41_model, v41_tokenizer, spec, **BUCKETS, **options)
    calls = _record_buckets(engine)
    assert [o.outputs[0].token_ids for o in run_all(engine, prompts, GREEDY)] == plain
    assert calls and engine.blocks.num_used == 0


def _check_mixed_steps_split(model, tokenizer, spec: dict, options: dict | None = None) -> None:
    """More requests than slots: later ones are admitted while others decode, so steps mix decodes and prefill
    chunks. Such a step runs its decodes from the buckets and its chunks eagerly, and gives plain decoding's
    tokens."""
    options = options or {}
    prompts = random_prompts(7, seed=9, low=20, high=70)
    plain = [out.outputs[0].token_ids for out in run_all(_engine(model, tokenizer, **options), prompts, GREEDY)]
    engine = _engine(model, tokenizer, spec, **BUCKETS, **options)
    calls = _record_buckets(engine)
    use_oracle_drafts(engine, {f"req-{i}": tokens for i, tokens in enumerate(plain)})
    assert [out.outputs[0].token_ids for out in run_all(engine, prompts, GREEDY)] == plain
    executor = engine.worker.speculative
    assert executor.split_steps > 0 and len(calls) == executor.graphed_steps + executor.split_steps
    assert engine.blocks.num_used == 0


def test_v4_mtp_mixed_steps_run_their_decodes_in_buckets(tiny_v4_model, tiny_v4_tokenizer):
    _check_mixed_steps_split(tiny_v4_model, tiny_v4_tokenizer, {"method": "mtp", "num_speculative_tokens": 3})


def test_v41_dspark_mixed_steps_run_their_decodes_in_buckets(v41_model, v41_tokenizer):
    spec = {"method": "dspark", "num_speculative_tokens": 3}
    _check_mixed_steps_split(v41_model, v41_tokenizer, spec, {"num_cache_blocks": 96, "block_tokens": 8})


def _check_deferred_first_drafts(model, tokenizer, spec: dict, options: dict | None = None) -> None:
    """First drafts deferred (the CUDA default): a sequence whose prompt just ended drafts nothing in that step
    (its drafter state still takes the prompt), verifies its next token with filler drafts in the buckets, and
    drafts from there; the tokens are plain decoding's."""
    options = options or {}
    prompts = random_prompts(5, seed=4, low=20, high=60)
    plain = [out.outputs[0].token_ids for out in run_all(_engine(model, tokenizer, **options), prompts, GREEDY)]
    engine = _engine(model, tokenizer, spec, **BUCKETS, **options)
    executor = engine.worker.speculative
    assert executor.defer_first_drafts is False  # the CPU runs its buckets eagerly: an eager first draft is cheap
    executor.defer_first_drafts = True
    drafter, seen = executor.drafter, []
    draft = drafter.draft

    def recording(inputs):
        seen.append((len(inputs.spans), len(inputs.drafting)))
        return draft(inputs)

    drafter.draft = recording
    graphs, undrafted = executor.graphs, []
    prepare = graphs.prepare

    def prepare_counting(step):  # graphed steps holding a sequence without drafts: a first token after its prompt
        undrafted.append(sum(not drafts for drafts in step.speculation.drafts))
        return prepare(step)

    graphs.prepare = prepare_counting
    use_oracle_drafts(engine, {f"req-{i}": tokens for i, tokens in enumerate(plain)})
    assert [out.outputs[0].token_ids for out in run_all(engine, prompts, GREEDY)] == plain
    assert seen and all(drafting == 0 for _, drafting in seen)  # the eager path saw prompts only: none drafted
    assert sum(undrafted) >= len(prompts)  # each first token verified in the buckets (and a last, out of room)
    assert engine.spec_stats.num_accepted_tokens > 0 and engine.blocks.num_used == 0


def test_v4_mtp_first_drafts_deferred_to_the_buckets(tiny_v4_model, tiny_v4_tokenizer):
    _check_deferred_first_drafts(tiny_v4_model, tiny_v4_tokenizer, {"method": "mtp", "num_speculative_tokens": 3})


def test_v41_dspark_first_drafts_deferred_to_the_buckets(v41_model, v41_tokenizer):
    spec = {"method": "dspark", "num_speculative_tokens": 3}
    _check_deferred_first_drafts(v41_model, v41_tokenizer, spec, {"num_cache_blocks": 96, "block_tokens": 8})


def test_v4_caches_after_rejections_in_buckets_equal_a_run_that_never_drafted(tiny_v4_model, tiny_v4_tokenizer):
    prompt = random_prompts(1, seed=5, low=25, high=26)[0]
    params = SamplingParams(temperature=0, max_tokens=26, ignore_eos=True)
    options = {"max_num_batched_tokens": 160}
    reference = run_all(_engine(tiny_v4_model, tiny_v4_tokenizer, **options), [prompt], params)[0]
    plain = _engine(tiny_v4_model, tiny_v4_tokenizer, **options)
    spec = _engine(tiny_v4_model, tiny_v4_tokenizer, {"method": "mtp", "num_speculative_tokens": 5}, **BUCKETS,
                   **options)  # fmt: skip
    calls = _record_buckets(spec)
    use_oracle_drafts(spec, {"req-0": reference.outputs[0].token_ids})
    plain.add_request(prompt, params)
    spec.add_request(prompt, params)
    partial = compare_caches_in_lockstep(spec, plain, v4_slot_state)
    assert partial >= 3 and len(calls) >= 5  # rolled back mid-run, across compressor windows of 4 and 32


def test_v41_caches_after_rejections_in_buckets_equal_a_run_that_never_drafted(v41_model, v41_tokenizer):
    prompt = random_prompts(1, seed=5, low=25, high=26)[0]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    options = {"num_cache_blocks": 64, "block_tokens": 8}
    reference = run_all(_engine(v41_model, v41_tokenizer, **options), [prompt], params)[0]
    # The run that never drafts keeps DSpark rings too (a confidence threshold of 1 cuts every draft), eagerly.
    never = _engine(v41_model, v41_tokenizer, {"method": "dspark", "num_speculative_tokens": 3,
                                               "confidence_threshold": 1.0}, **options)  # fmt: skip
    spec = _engine(v41_model, v41_tokenizer, {"method": "dspark", "num_speculative_tokens": 3}, **BUCKETS, **options)
    calls = _record_buckets(spec)
    use_oracle_drafts(spec, {"req-0": reference.outputs[0].token_ids})
    never.add_request(prompt, params)
    spec.add_request(prompt, params)
    partial = compare_caches_in_lockstep(spec, never, v41_slot_state)
    assert never.spec_stats.num_draft_tokens == 0
    assert partial >= 2 and len(calls) >= 4


def _steady_engine(model, tokenizer, spec: dict, **options) -> LLMEngine:
    """Three sequences decoding with drafts in bucket 4 (the static buffers hold a real step)."""
    engine = _engine(model, tokenizer, spec, **BUCKETS, **options)
    for prompt in random_prompts(3, seed=7, low=12, high=30):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    calls = _record_buckets(engine)
    while not calls:
        engine.step()
    assert calls[-1][:2] == (3, 4)
    return engine


def _check_replayed_region_reads_nothing_on_the_host(engine: LLMEngine) -> None:
    """The bucket's verify and draft forwards over the last step's inputs again (their cache writes are a test's
    business only), with every device-to-host read and every tensor made from host data refused."""
    graphs = engine.worker.speculative.graphs
    with torch.inference_mode():
        graphs.logits.zero_()
        graphs.drafts.fill_(-1)
        with RefuseHostReads(host_data=True):
            graphs._verify_forward(4)
            graphs._draft_forward(4)
    rows = 4 * graphs.width
    assert torch.isfinite(graphs.logits[:rows]).all() and graphs.logits[:rows].abs().sum() > 0
    assert (graphs.drafts[:4, :-1] >= 0).all() and (graphs.drafts[:4, -1] == graphs.num_drafts).all()


def test_v4_verify_and_draft_steps_read_nothing_on_the_host(tiny_checkpoint, tiny_v4_tokenizer):
    model = load_model(tiny_checkpoint, progress=False)  # its experts are swapped for a sync-free stand-in
    engine = _steady_engine(model, tiny_v4_tokenizer, {"method": "mtp", "num_speculative_tokens": 3})
    _dense_experts(model)
    _use_gathered_moe(model)
    _check_replayed_region_reads_nothing_on_the_host(engine)


def test_v41_verify_and_draft_steps_read_nothing_on_the_host(tiny_v41_checkpoint, v41_tokenizer):
    """Every CSA2 layer role, Engram rows and history, quantized cache storage, the DSpark stages' seeding and
    block drafting."""
    model = load_model(tiny_v41_checkpoint, progress=False)
    engine = _steady_engine(model, v41_tokenizer, {"method": "dspark", "num_speculative_tokens": 3},
                            num_cache_blocks=64, block_tokens=8)  # fmt: skip
    assert engine.runner.cache.quantized_storage
    _dense_experts(model)
    _use_gathered_moe(model)
    _check_replayed_region_reads_nothing_on_the_host(engine)


def test_enforce_eager_and_the_cpu_default_keep_speculative_steps_eager(tiny_v4_model, tiny_v4_tokenizer):
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    assert _engine(tiny_v4_model, tiny_v4_tokenizer, spec, **BUCKETS, enforce_eager=True).worker.speculative.graphs \
        is None  # fmt: skip
    assert _engine(tiny_v4_model, tiny_v4_tokenizer, spec).worker.speculative.graphs is None
    graphs = _engine(tiny_v4_model, tiny_v4_tokenizer, spec, cuda_graph_sizes=(1, 3, 8)).worker.speculative.graphs
    assert graphs.sizes == (1, 3) and graphs.width == 3  # buckets past max_num_seqs are dropped


def _record_drafts(engine: LLMEngine) -> dict[str, list[list[int]]]:
    """Every request's drafts, step after step, as the engine stores them."""
    take, drafts = engine._take_verified, {}

    def recording(seq, result, now):
        text_made = take(seq, result, now)
        drafts.setdefault(seq.request_id, []).append(list(result.next_drafts))
        return text_made

    engine._take_verified = recording
    return drafts


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_the_drafters_propose_in_buckets_what_they_propose_eagerly(
    tiny_v4_model, tiny_v4_tokenizer, v41_model, v41_tokenizer, method
):
    """Rejected columns run in the spare slot, so the drafters' own state (the MTP layer's ring, the DSpark rings)
    holds the kept positions only, as after an eager step: the same drafts every step."""
    model, tokenizer, options = (tiny_v4_model, tiny_v4_tokenizer, {}) if method == "mtp" else (
        v41_model, v41_tokenizer, {"num_cache_blocks": 64, "block_tokens": 8})  # fmt: skip
    spec = {"method": method, "num_speculative_tokens": 3}
    prompts = random_prompts(3, seed=11, low=10, high=40)
    eager = _engine(model, tokenizer, spec, **options)
    bucketed = _engine(model, tokenizer, spec, **BUCKETS, **options)
    calls = _record_buckets(bucketed)
    expected, got = _record_drafts(eager), _record_drafts(bucketed)
    run_all(bucketed, prompts, GREEDY)
    run_all(eager, prompts, GREEDY)
    assert got == expected and len(calls) >= 4
