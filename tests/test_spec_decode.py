"""Speculative decoding with V4's MTP layer: exactly plain decoding's tokens, caches rolled back, blocks returned.

The tiny random model's MTP layer almost never guesses right, so these tests also run an *oracle* drafter that
proposes plain decoding's own continuation with one wrong token at a varying place: every acceptance length
(none, some, all) and every rollback point comes up.
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
from dsinfer.engine.detokenizer import IncrementalDetokenizer
from dsinfer.engine.engine import LLMEngine
from dsinfer.sampling_params import SamplingParams, StructuredOutput

BASE = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 160}


def _engine(model, tokenizer, k: int | None = None, **options) -> LLMEngine:
    spec = None if k is None else {"method": "mtp", "num_speculative_tokens": k}
    return LLMEngine(model, tokenizer, EngineConfig(**{**BASE, **options}, speculative_config=spec))


def _tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


SMALL = {"num_cache_blocks": 4, "max_num_batched_tokens": 40, "max_model_len": 96}  # preemptions, chunking
PROMPTS = random_prompts(4, seed=1, low=56, high=63)  # block 2 fills while decoding
GREEDY = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_tokens(tiny_v4_model, tiny_v4_tokenizer):
    return _tokens(run_all(_engine(tiny_v4_model, tiny_v4_tokenizer, **SMALL), PROMPTS, GREEDY))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_mixed_batch_with_chunking_and_preemption_matches_plain_decoding(
    tiny_v4_model, tiny_v4_tokenizer, plain_tokens, k
):
    # The MTP layer drafts every step; the oracle then swaps in drafts that are partly right.
    check_oracle_run_matches_plain(
        _engine(tiny_v4_model, tiny_v4_tokenizer, k, **SMALL), PROMPTS, GREEDY, plain_tokens, k
    )


def test_greedy_with_the_mtp_layers_own_drafts_matches_plain_decoding(tiny_v4_model, tiny_v4_tokenizer, plain_tokens):
    drafted = _engine(tiny_v4_model, tiny_v4_tokenizer, 3, **SMALL)
    assert _tokens(run_all(drafted, PROMPTS, GREEDY)) == plain_tokens
    assert drafted.spec_stats.num_draft_tokens > 0 and drafted.blocks.num_used == 0


def test_prefix_hits_stop_strings_stop_tokens_and_max_tokens_inside_an_accepted_run(tiny_v4_model, tiny_v4_tokenizer):
    shared = random_prompts(1, seed=3, low=66, high=67)[0]
    prompts = [shared + [7, 8, 9], shared + [10], shared + [7, 8, 9]]
    free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = _engine(tiny_v4_model, tiny_v4_tokenizer, max_model_len=200)
    reference = [run_all(plain, [p], free)[0].outputs[0] for p in prompts]
    spec = _engine(tiny_v4_model, tiny_v4_tokenizer, 4, max_model_len=200)
    use_oracle_drafts(spec, {f"req-{i}": r.token_ids for i, r in enumerate(reference)})
    got = [run_all(spec, [p], free)[0].outputs[0] for p in prompts]
    assert [g.token_ids for g in got] == [r.token_ids for r in reference]
    assert spec.blocks.prefix_hits >= 2 * (len(shared) // spec.blocks.block_tokens) > 0
    # Stop rules end a completion in the middle of an accepted run, exactly where plain decoding stops.
    check_stop_rules_inside_accepted_runs(
        plain, lambda: _engine(tiny_v4_model, tiny_v4_tokenizer, 5, max_model_len=200), prompts[0], reference[0]
    )


def _slot_state(engine: LLMEngine, seq) -> list[torch.Tensor]:
    """What the cache holds for ``seq``'s computed positions: window rows, unfinished windows, entries."""
    cache, n, slot = engine.runner.cache, seq.num_computed, seq.slot
    parts = []
    for layer in cache.layers[: engine.model.config.num_hidden_layers]:
        width = layer.window.shape[1]
        positions = torch.arange(max(0, n - width), n)
        parts.append(layer.window[slot, positions % width])
        for compressor in (layer.compressor, layer.indexer):
            if compressor is None:
                continue
            ratio = compressor.ratio
            parts += [compressor.pending_values[slot, : n % ratio], compressor.pending_gates[slot, : n % ratio]]
            if compressor.overlap and n >= ratio:
                parts += [compressor.previous_values[slot], compressor.previous_gates[slot]]
            per_block = compressor.entries.shape[1]
            entries = torch.arange(n // ratio)
            table = torch.tensor(seq.block_table, dtype=torch.long)
            parts.append(compressor.entries[table[entries // per_block], entries % per_block])
    return parts


def test_a_verified_run_without_stop_strings_is_detokenized_once_a_step(tiny_v4_model, tiny_v4_tokenizer, monkeypatch):
    """Only stop strings need a verified run's text token by token: without them the whole run is detokenized in one
    push, after the next step is launched, and the text is plain decoding's."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = run_all(_engine(tiny_v4_model, tiny_v4_tokenizer), PROMPTS[:1], params)[0].outputs[0]
    engine = _engine(tiny_v4_model, tiny_v4_tokenizer, 3)
    use_oracle_drafts(engine, {"req-0": expected.token_ids})
    pushes, steps, push = [0], [0], IncrementalDetokenizer.push

    def counting_push(detokenizer, token_ids):
        pushes[0] += 1
        return push(detokenizer, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "push", counting_push)
    step = engine.step

    def counting_step():
        steps[0] += 1
        return step()

    engine.step = counting_step
    got = run_all(engine, PROMPTS[:1], params)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text, expected.finish_reason)
    assert engine.spec_stats.num_accepted_tokens > 0
    assert pushes[0] <= steps[0] < len(expected.token_ids)


def test_caches_after_rejected_drafts_equal_a_run_that_never_drafted(tiny_v4_model, tiny_v4_tokenizer):
    prompt = random_prompts(1, seed=5, low=25, high=26)[0]
    params = SamplingParams(temperature=0, max_tokens=26, ignore_eos=True)
    options = {"max_num_batched_tokens": 160}
    reference = run_all(_engine(tiny_v4_model, tiny_v4_tokenizer, **options), [prompt], params)[0]
    plain = _engine(tiny_v4_model, tiny_v4_tokenizer, **options)
    spec = _engine(tiny_v4_model, tiny_v4_tokenizer, 5, **options)
    use_oracle_drafts(spec, {"req-0": reference.outputs[0].token_ids})
    plain.add_request(prompt, params)
    spec.add_request(prompt, params)
    partial = compare_caches_in_lockstep(spec, plain, _slot_state)
    assert partial >= 3  # rolled back mid-run several times, across compressor windows of 4 and 32


def test_seeded_sampling_replays_and_is_batch_invariant(tiny_v4_model, tiny_v4_tokenizer):
    probe = random_prompts(1, seed=9)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=8, ignore_eos=True)
    alone = run_all(_engine(tiny_v4_model, tiny_v4_tokenizer, 3), [probe], params)[0].outputs[0].token_ids
    others = random_prompts(3, seed=10, high=40)
    busy_params = [SamplingParams(temperature=1.0, seed=s, max_tokens=10, ignore_eos=True) for s in range(3)]
    busy = run_all(_engine(tiny_v4_model, tiny_v4_tokenizer, 3), others[:2] + [probe] + others[2:],
                   busy_params[:2] + [params] + busy_params[2:])  # fmt: skip
    assert busy[2].outputs[0].token_ids == alone and len(alone) == 8


def test_grammar_constrained_requests_accept_only_what_the_grammar_allows(tiny_v4_model, tiny_v4_tokenizer):
    structured = StructuredOutput("regex", "[a-f]{3,12}")
    params = SamplingParams(temperature=0, max_tokens=20, structured_output=structured)
    prompt = random_prompts(1, seed=2)[0]
    expected = run_all(_engine(tiny_v4_model, tiny_v4_tokenizer), [prompt], params)[0].outputs[0]
    spec = _engine(tiny_v4_model, tiny_v4_tokenizer, 3)
    # The oracle proposes plain decoding's (grammar-abiding) tokens with one forbidden-or-wrong token among them.
    use_oracle_drafts(spec, {"req-0": expected.token_ids})
    out = run_all(spec, [prompt], params)[0].outputs[0]
    assert out.token_ids == expected.token_ids and out.text == expected.text
    assert spec.spec_stats.num_accepted_tokens > 0


def test_two_hundred_requests_return_every_block(tiny_v4_model, tiny_v4_tokenizer):
    engine = _engine(tiny_v4_model, tiny_v4_tokenizer, 3, num_cache_blocks=30, max_num_seqs=16,
                     max_num_batched_tokens=128)  # fmt: skip
    check_many_requests_return_every_block(engine)


@pytest.mark.parametrize(("spec", "message"), [
    ('{"method": "mtp"', "speculative_config: not valid JSON"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "speculative_config 'method': expected one of mtp, dspark"),
    ('{"method": "mtp", "num_speculative_tokens": 6}', "'num_speculative_tokens': expected an integer from 1 to 5"),
    ('{"method": "mtp", "num_speculative_tokens": 0}', "'num_speculative_tokens': expected an integer from 1 to 5"),
    ('{"method": "mtp"}', "speculative_config 'num_speculative_tokens': missing"),
    ('{"method": "mtp", "num_speculative_tokens": 2, "draft": 1}', "unknown field 'draft'"),
    ('[1]', "speculative_config: expected a JSON object"),
])  # fmt: skip
def test_bad_speculative_configs_name_the_field(spec, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(speculative_config=spec)


def test_methods_the_checkpoint_cannot_serve_are_refused(tiny_v4_model, tiny_v4_tokenizer):
    with pytest.raises(ConfigError, match="'dspark' drafts with DeepSeek-V4.1's DSpark stages; this is a V4"):
        LLMEngine(tiny_v4_model, tiny_v4_tokenizer, EngineConfig(**BASE, speculative_config={
            "method": "dspark", "num_speculative_tokens": 2}))  # fmt: skip
    mtp = tiny_v4_model.mtp
    tiny_v4_model.mtp = torch.nn.ModuleList()
    try:
        with pytest.raises(ConfigError, match="needs the checkpoint's MTP layers, and this one has none"):
            _engine(tiny_v4_model, tiny_v4_tokenizer, 2)
    finally:
        tiny_v4_model.mtp = mtp


def test_mtp_on_a_v41_checkpoint_is_refused_with_the_reason():
    from dsinfer.models.deepseek_v41 import DeepseekV41
    from dsinfer.models.tiny import tiny_config_v41
    from dsinfer.speculative.support import check_speculative_support

    model = DeepseekV41(tiny_config_v41())
    with pytest.raises(ConfigError, match="'mtp' needs V4's MTP layers; a V4.1 checkpoint drafts with DSpark"):
        check_speculative_support(model, SpeculativeConfig("mtp", 2))
