"""Helpers the engine tests share: random prompts and running requests to completion."""

from __future__ import annotations

import torch

from dsinfer.engine.engine import LLMEngine
from dsinfer.engine.outputs import RequestOutput
from dsinfer.sampling_params import SamplingParams


def random_prompts(count: int, seed: int, low: int = 3, high: int = 110) -> list[list[int]]:
    """``count`` prompts of random ids in [3, 500) with lengths in [low, high), reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=gen).tolist()
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]


def run_all(
    engine: LLMEngine,
    prompts: list,
    params: SamplingParams | list[SamplingParams],
    abort_after: dict[int, str] | None = None,
) -> list[RequestOutput | None]:
    """Queue every prompt, step until the engine is idle; final outputs in prompt order (None if aborted).

    ``abort_after`` maps a step count to a request id to abort right after that step.
    """
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    results, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        steps += 1
        if abort_after and steps in abort_after:
            engine.abort(abort_after[steps])
    return [results.get(i) for i in ids]


def use_oracle_drafts(engine: LLMEngine, references: dict[str, list[int]]) -> None:
    """Replace the drafter's drafts by the reference continuation, one draft wrong at a place that moves each step.

    Tiny random drafters almost never guess right; the oracle makes every acceptance length (none, some, all)
    and every rollback point come up. The drafter still runs (and keeps its own state) every step."""
    take, calls = engine._take_verified, [0]

    def take_with_oracle(seq, result, now):
        text_made = take(seq, result, now)
        if seq.is_finished:
            return text_made
        produced, count = len(seq.output_token_ids), len(seq.draft_token_ids)
        drafts = list(references[seq.request_id][produced : produced + count])
        calls[0] += 1
        wrong = calls[0] % (count + 1)  # == count: every draft right
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % engine.model.config.vocab_size
        seq.draft_token_ids = drafts
        return text_made

    engine._take_verified = take_with_oracle


def compare_caches_in_lockstep(spec: LLMEngine, plain: LLMEngine, slot_state) -> int:
    """Step ``spec`` (drafting, one request "req-0" added to both) to the end; after each of its steps, step
    ``plain`` (which never drafts) to the same computed length and require ``slot_state(engine, seq)`` (a list of
    the sequence's cache tensors) equal. Returns how many steps accepted some but not all of their drafts (each a
    rollback mid-run)."""
    partial = 0
    while spec.has_unfinished_requests():
        before = (spec.spec_stats.num_draft_tokens, spec.spec_stats.num_accepted_tokens)
        spec.step()
        if not spec.scheduler.running:
            break
        seq = spec.scheduler.running[0]
        drafted = spec.spec_stats.num_draft_tokens - before[0]
        accepted = spec.spec_stats.num_accepted_tokens - before[1]
        partial += 0 < accepted < drafted
        plain_seq = plain.requests["req-0"][0]
        while plain_seq.num_computed < seq.num_computed:
            plain.step()
        assert plain_seq.num_computed == seq.num_computed
        for got, want in zip(slot_state(spec, seq), slot_state(plain, plain_seq), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    return partial


def check_oracle_run_matches_plain(oracle: LLMEngine, prompts, params, plain_tokens: list[list[int]], k: int) -> None:
    """With oracle drafts (some right, some wrong), ``oracle`` gives plain decoding's tokens, preempting and
    rolling back along the way, counts acceptance per draft position, and leaves no block in use."""
    use_oracle_drafts(oracle, {f"req-{i}": tokens for i, tokens in enumerate(plain_tokens)})
    assert [list(r.outputs[0].token_ids) for r in run_all(oracle, prompts, params)] == plain_tokens
    stats = oracle.spec_stats
    assert oracle.scheduler.num_preemptions > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert len(stats.accepted_per_position) == k and sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert stats.accepted_per_position[min(k, 3) - 1] > 0  # whole runs accepted too (k = 1, 3)
    assert oracle.blocks.num_used == 0


def check_stop_rules_inside_accepted_runs(plain: LLMEngine, make_oracle, prompt: list[int], reference) -> None:
    """A stop string, a stop token and max_tokens end a completion in the middle of an accepted run exactly where
    plain decoding stops; ``reference`` is plain decoding's free-running output for ``prompt``, ``make_oracle()``
    a fresh speculative engine."""
    text, ids = reference.text, reference.token_ids
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    limits = [
        SamplingParams(temperature=0, max_tokens=10, stop=[needle], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ids[6]]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    ]
    for params in limits:
        expected = run_all(plain, [prompt], params)[0].outputs[0]
        oracle = make_oracle()
        use_oracle_drafts(oracle, {"req-0": ids})
        out = run_all(oracle, [prompt], params)[0].outputs[0]
        assert (out.token_ids, out.text, out.finish_reason) == (
            expected.token_ids, expected.text, expected.finish_reason
        )  # fmt: skip
        assert oracle.spec_stats.num_accepted_tokens > 0 and oracle.blocks.num_used == 0


def check_many_requests_return_every_block(engine: LLMEngine) -> None:
    """200 short requests (greedy and seeded sampling, 1-5 tokens) through a speculative ``engine`` with 16
    sequences: all finish, drafts run, and every block and slot goes back."""
    prompts = random_prompts(200, seed=4, low=2, high=12)
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=1 + i % 5) for i in range(200)]
    outputs = run_all(engine, prompts, params)
    assert len(outputs) == 200 and all(o.finished for o in outputs)
    assert engine.blocks.num_used == 0
    assert sorted(engine.scheduler.free_slots) == list(range(16))
    assert engine.spec_stats.num_drafts > 0
