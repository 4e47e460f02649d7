"""Speculative decoding with V4.1's DSpark stages: exactly plain decoding's tokens, caches rolled back, blocks
returned, and the embedded default's trained drafts accepted.

The tiny random V4.1 (every CSA2 layer role, Engram on two layers, two DSpark stages, here with the release's
block of 5) drafts almost nothing right, so most tests also run the *oracle* drafter of tests/test_spec_decode.py
(plain decoding's continuation with one wrong token at a moving place) while the DSpark stages still run and
keep their rings every step. As in tests/test_engine_v41.py, comparisons of two evaluation orders turn the
trained-in fake quantization off (a value within float32 noise of a rounding midpoint can land on another FP8
code); the default model runs as loaded, quantized cache storage included.
"""

from __future__ import annotations

import pytest
import torch
from engine_harness import (
    check_many_requests_return_every_block,
    check_oracle_run_matches_plain,
    check_stop_rules_inside_accepted_runs,
    compare_caches_in_lockstep,
    random_prompts,
    run_all,
    use_oracle_drafts,
)

from dsinfer.config import ConfigError, EngineConfig, SpeculativeConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.kv.batch import PackedBatch, SequenceSpan
from dsinfer.kv.cache_v41 import KVCacheV41
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import default_model_dir, make_tiny_checkpoint
from dsinfer.sampling_params import SamplingParams
from dsinfer.speculative.dspark import verified_draft_counts
from dsinfer.speculative.rollback import CacheRollback
from dsinfer.speculative.support import check_speculative_support
from dsinfer.tokenizer import Tokenizer

BASE = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 160, "block_tokens": 16}
SMALL = {"num_cache_blocks": 8, "max_num_batched_tokens": 40, "max_model_len": 96}  # preemptions, chunking
PROMPTS = random_prompts(4, seed=1, low=56, high=63)  # the fourth block fills while decoding
GREEDY = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny V4.1 checkpoint with the release's DSpark block of 5 (the shared fixture's block is 3)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-v41-block5"), seed=0, arch="v41", dspark_block_size=5)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint, progress=False).set_fake_quantization(False)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer.from_dir(checkpoint)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(model, tokenizer, k: int | None = None, threshold: float = 0.0, **options) -> LLMEngine:
    spec = None if k is None else {"method": "dspark", "num_speculative_tokens": k, "confidence_threshold": threshold}
    return LLMEngine(model, tokenizer, EngineConfig(**{**BASE, **options}, speculative_config=spec))


def _tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def plain_tokens(model, tokenizer):
    return _tokens(run_all(_engine(model, tokenizer, **SMALL), PROMPTS, GREEDY))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_mixed_batch_with_chunking_and_preemption_matches_plain_decoding(model, tokenizer, plain_tokens, k):
    check_oracle_run_matches_plain(_engine(model, tokenizer, k, **SMALL), PROMPTS, GREEDY, plain_tokens, k)


def test_greedy_with_the_dspark_stages_own_drafts_matches_plain_decoding(model, tokenizer, plain_tokens):
    drafted = _engine(model, tokenizer, 5, **SMALL)
    lengths = _record_draft_lengths(drafted)
    assert _tokens(run_all(drafted, PROMPTS, GREEDY)) == plain_tokens
    assert set(lengths) == {5} and drafted.spec_stats.num_draft_tokens > 0 and drafted.blocks.num_used == 0


def _record_draft_lengths(engine: LLMEngine) -> list[int]:
    """How many drafts the drafter proposes for each sequence, before the engine trims them to the room left."""
    drafter, lengths = engine.worker.speculative.drafter, []
    draft = drafter.draft

    def recording(inputs):
        drafts = draft(inputs)
        lengths.extend(len(d) for d in drafts)
        return drafts

    drafter.draft = recording
    return lengths


def test_prefix_hits_stop_strings_stop_tokens_and_max_tokens_inside_an_accepted_run(model, tokenizer):
    # A shared prefix longer than the replay (layers x window = 144 positions): the hit replays from position 48,
    # so the Engram history of the slot is rebuilt before the speculative forward.
    shared = random_prompts(1, seed=3, low=200, high=201)[0]
    prompts = [shared + [7, 8, 9], shared + [10], shared + [7, 8, 9]]
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    options = {"max_model_len": 260, "max_num_batched_tokens": 260}
    plain = _engine(model, tokenizer, **options)
    reference = [run_all(plain, [p], free)[0].outputs[0] for p in prompts]
    spec = _engine(model, tokenizer, 4, **options)
    use_oracle_drafts(spec, {f"req-{i}": r.token_ids for i, r in enumerate(reference)})
    got = [run_all(spec, [p], free)[0].outputs[0] for p in prompts]
    assert [g.token_ids for g in got] == [r.token_ids for r in reference]
    assert spec.blocks.prefix_hits >= 2 * (len(shared) // spec.blocks.block_tokens) > 0
    assert spec.spec_stats.num_accepted_tokens > 0
    check_stop_rules_inside_accepted_runs(
        plain, lambda: _engine(model, tokenizer, 5, **options), prompts[0], reference[0]
    )


def _slot_state(engine: LLMEngine, seq) -> list[torch.Tensor]:
    """Everything the cache holds for ``seq``'s computed positions: window rows, unfinished pairs, entries and
    index keys, the Engram look-back, the DSpark rings."""
    cache, n, slot = engine.runner.cache, seq.num_computed, seq.slot
    window = engine.model.config.sliding_window
    positions = torch.arange(max(0, n - window), n)
    parts = []
    for layer_id, layer in enumerate(cache.layers):
        parts.append(cache.read_window(layer_id, slot, positions))
        source = layer.source
        if source is None:
            continue
        if source.pending_values is not None:
            pending = n % source.ratio
            parts += [source.pending_values[slot, :pending], source.pending_gates[slot, :pending]]
        parts += cache.read_entries(layer_id, seq.block_table, n // source.ratio)
    parts.append(cache.engram_history[slot])
    parts += [ring[slot, positions % window] for ring in cache.dspark_rings]
    return parts


def test_caches_after_rejected_drafts_equal_a_run_that_never_drafted(model, tokenizer):
    prompt = random_prompts(1, seed=5, low=25, high=26)[0]
    params = SamplingParams(temperature=0, max_tokens=26, ignore_eos=True)
    reference = run_all(_engine(model, tokenizer), [prompt], params)[0]
    # The run that never drafts keeps DSpark rings too: a confidence threshold of 1 cuts every draft.
    never = _engine(model, tokenizer, 5, threshold=1.0)
    spec = _engine(model, tokenizer, 5)
    use_oracle_drafts(spec, {"req-0": reference.outputs[0].token_ids})
    never.add_request(prompt, params)
    spec.add_request(prompt, params)
    partial = compare_caches_in_lockstep(spec, never, _slot_state)
    assert never.spec_stats.num_draft_tokens == 0
    assert partial >= 3  # rolled back mid-run several times, across ratio-2 pairs and ratio-1 entries


def test_rollback_restores_quantized_storage_and_the_engram_history(checkpoint):
    """With FP8 / FP4 storage, the rejected positions' codes and scales come back byte for byte."""
    model = load_model(checkpoint, progress=False)  # fake quantization on: the cache keeps codes and scales
    cache = KVCacheV41(model.config, 2, 8, 16, torch.float32, "cpu", with_dspark=True, quantized_storage=True)
    tokens = random_prompts(1, seed=8, low=37, high=38)[0]
    table = [5, 2, 7]
    with torch.inference_mode():
        model(PackedBatch(torch.tensor(tokens[:31]), torch.arange(31), [SequenceSpan(0, 31, 1, table)], cache))
        before = _tensors(cache)
        rollback = CacheRollback(cache, model.config.num_hidden_layers, model.engram_hasher)
        span = SequenceSpan(31, 6, 1, table)
        verify = torch.tensor(tokens[31:])
        snapshot = rollback.snapshot(span, verify)
        span.journal = []
        model(PackedBatch(verify, torch.arange(31, 37), [span], cache))
        rollback.rollback(snapshot, span.journal, keep=2)  # positions 31, 32 kept
    after = _tensors(cache)
    window, rejected = model.config.sliding_window, torch.arange(33, 37)
    for layer_id, layer in enumerate(cache.layers):
        for name in ("window", "window_scales"):
            saved, now = before[f"{layer_id}.{name}"], after[f"{layer_id}.{name}"]
            assert torch.equal(now[1, rejected % window], saved[1, rejected % window])
        source = layer.source
        if source is None:
            continue
        entries = torch.arange(33 // source.ratio, 37 // source.ratio)  # windows a rejected position completed
        blocks, rows = torch.tensor(table)[entries // (16 // source.ratio)], entries % (16 // source.ratio)
        for name in ("entries", "index_keys", "entry_scales", "index_key_scales"):
            saved, now = before[f"{layer_id}.{name}"], after[f"{layer_id}.{name}"]
            assert torch.equal(now[blocks, rows], saved[blocks, rows])
    expected = model.engram_hasher.next_contexts(torch.tensor(tokens[:33]), [33])[0]
    assert torch.equal(cache.engram_history[1], expected)


def _tensors(cache: KVCacheV41) -> dict[str, torch.Tensor]:
    """Byte copies of every window and entry tensor, by layer and name."""
    out = {}
    for layer_id, layer in enumerate(cache.layers):
        out[f"{layer_id}.window"] = layer.window.view(torch.uint8).clone()
        out[f"{layer_id}.window_scales"] = layer.window_scales.view(torch.uint8).clone()
        if layer.source is not None:
            for name in ("entries", "index_keys", "entry_scales", "index_key_scales"):
                out[f"{layer_id}.{name}"] = getattr(layer.source, name).view(torch.uint8).clone()
    return out


def test_seeded_sampling_replays_and_is_batch_invariant(model, tokenizer):
    probe = random_prompts(1, seed=9, high=40)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=8, ignore_eos=True)
    alone = run_all(_engine(model, tokenizer, 3), [probe], params)[0].outputs[0].token_ids
    others = random_prompts(3, seed=10, high=40)
    busy_params = [SamplingParams(temperature=1.0, seed=s, max_tokens=10, ignore_eos=True) for s in range(3)]
    busy = _engine(model, tokenizer, 3)
    outputs = run_all(busy, others[:2] + [probe] + others[2:], busy_params[:2] + [params] + busy_params[2:])
    assert outputs[2].outputs[0].token_ids == alone and len(alone) == 8
    assert busy.spec_stats.num_draft_tokens > 0


def test_two_hundred_requests_return_every_block(model, tokenizer):
    engine = _engine(model, tokenizer, 3, num_cache_blocks=30, max_num_seqs=16, max_num_batched_tokens=128)
    check_many_requests_return_every_block(engine)


def test_the_confidence_head_cuts_drafts_at_the_first_unsure_column():
    confidence = torch.tensor([[3.0, 1.0, -2.0, 4.0], [-1.0, 5.0, 5.0, 5.0], [2.0, 2.0, 2.0, 2.0]])
    assert verified_draft_counts(confidence, 0.5).tolist() == [2, 0, 4]  # sigmoid(-2) < 0.5 ends row 0's run
    assert verified_draft_counts(confidence, 0.0).tolist() == [4, 4, 4]  # threshold 0: every draft verified


# ---- the embedded default: trained drafts --------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_model():
    directory = default_model_dir()
    return load_model(directory, progress=False), Tokenizer.from_dir(directory)


def _default_prompts(tokenizer) -> list[list[int]]:
    from dsinfer.chat.format import ChatFormat
    from dsinfer.training import corpus
    from dsinfer.training.render import SampleRenderer

    renderer = SampleRenderer(ChatFormat(tokenizer, "v41", "default"))
    samples = corpus.held_out("arithmetic", 1) + corpus.held_out("tools", 1) + corpus.held_out("greetings", 1)
    return [renderer.prompt_ids(sample) for sample in samples]


@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_the_default_models_trained_drafts_are_accepted(default_model, threshold):
    model, tokenizer = default_model
    prompts = _default_prompts(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=48)
    options = {"max_model_len": 1024, "max_num_batched_tokens": 1024, "block_tokens": 64}
    plain = _tokens(run_all(_engine(model, tokenizer, **options), prompts, params))
    spec = _engine(model, tokenizer, 5, threshold, **options)
    lengths = _record_draft_lengths(spec)
    assert _tokens(run_all(spec, prompts, params)) == plain
    stats = spec.spec_stats
    assert stats.mean_acceptance_length > 1.5, stats  # tau: tokens per verify step
    if threshold:  # the confidence head cut some blocks short
        assert min(lengths) < 5 and max(lengths) > 0
    else:
        assert set(lengths) == {5}
    assert spec.blocks.num_used == 0


def test_the_engines_drafts_are_the_blocks_the_training_loss_scores(default_model):
    """Rings, positions and the Markov bias as trained: each verify round's drafts equal the argmax of
    ``draft_blocks_logits`` (one full forward of the finished sequence) at the same anchor, column by column while
    the drafts are right (past a wrong draft the training feeds the true token to the Markov head)."""
    from dsinfer.training.draft_loss import draft_blocks_logits

    model, tokenizer = default_model
    prompt = _default_prompts(tokenizer)[0]
    engine = _engine(model, tokenizer, 5, max_model_len=1024, max_num_batched_tokens=1024, block_tokens=64)
    drafter, rounds = engine.worker.speculative.drafter, []
    draft = drafter.draft

    def recording(inputs):
        drafts = draft(inputs)
        rows = inputs.last_rows()
        rounds.extend((int(inputs.positions[row]), d) for row, d in zip(rows, drafts, strict=True))
        return drafts

    drafter.draft = recording
    ids = prompt + run_all(engine, [prompt], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0].token_ids
    size = model.config.dspark_block_size
    rounds = [(anchor, drafts) for anchor, drafts in rounds if anchor + 2 + size <= len(ids)]
    with torch.inference_mode():
        streams, pre_mix, ctx = model.run_layers(PackedBatch.from_sequences([ids]), capture=True)
        targets = torch.cat([ctx.captured[i] for i in model.config.dspark_target_layer_ids], dim=-1)
        logits, _ = draft_blocks_logits(model, targets, torch.tensor(ids), [(0, anchor) for anchor, _ in rounds])
    compared = accepted = 0
    for (anchor, drafts), block in zip(rounds, logits.argmax(dim=-1).tolist(), strict=True):
        truth = ids[anchor + 2 : anchor + 2 + size]
        for column, (got, want) in enumerate(zip(drafts, block, strict=True)):
            assert got == want, (anchor, column, drafts, block)
            compared += 1
            if got != truth[column]:
                break
            accepted += 1
    assert len(rounds) >= 10 and accepted >= len(rounds) and compared > len(rounds)


# ---- what cannot be served -------------------------------------------------------------------------------
def test_speculative_configs_a_v41_checkpoint_cannot_serve_are_refused(model, tokenizer, tiny_v41_checkpoint):
    with pytest.raises(ConfigError, match="'mtp' needs V4's MTP layers; a V4.1 checkpoint drafts with DSpark"):
        LLMEngine(model, tokenizer, EngineConfig(**BASE, speculative_config={
            "method": "mtp", "num_speculative_tokens": 2}))  # fmt: skip
    small_block = load_model(tiny_v41_checkpoint, progress=False)  # a DSpark block of 3
    with pytest.raises(ConfigError, match=r"'num_speculative_tokens': 4 exceeds the checkpoint's DSpark block size"):
        check_speculative_support(small_block, SpeculativeConfig("dspark", 4))
    check_speculative_support(small_block, SpeculativeConfig("dspark", 3))
    stages = model.mtp
    model.mtp = torch.nn.ModuleList()
    try:
        with pytest.raises(ConfigError, match="'dspark' needs the checkpoint's DSpark stages, and this one has none"):
            _engine(model, tokenizer, 2)
    finally:
        model.mtp = stages


@pytest.mark.parametrize(("spec", "message"), [
    ({"method": "mtp", "num_speculative_tokens": 2, "confidence_threshold": 0.5},
     "'confidence_threshold': only 'dspark' drafts have a confidence head"),
    ({"method": "dspark", "num_speculative_tokens": 2, "confidence_threshold": 1.5},
     "'confidence_threshold': expected a number from 0 to 1, got 1.5"),
    ({"method": "dspark", "num_speculative_tokens": 2, "confidence_threshold": "high"},
     "'confidence_threshold': expected a number from 0 to 1, got 'high'"),
])  # fmt: skip
def test_bad_confidence_thresholds_name_the_field(spec, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(speculative_config=spec)
