"""A speculative step judges its sequences together: the same tokens as judging each alone, few host reads.

The batched judge (:func:`~dsinfer.speculative.verify.judge_batched`) must emit exactly what the one-sequence
path emits (greedy: the same tokens; sampled: the same tokens from the same seeded generators; logprobs), and a
whole verify step (snapshot, forward, judge, rollback, draft) may read the device on the host only twice,
whatever the batch: once for the judged tokens, once for the next drafts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from engine_harness import random_prompts

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.layers.moe import MoE
from dsinfer.models.loader import load_model
from dsinfer.ops.moe.weights import ExpertWeights, dequantize_expert
from dsinfer.sampling.sampler import Sampler, make_sampling_state
from dsinfer.sampling_params import SamplingParams
from dsinfer.speculative.rejection import accept_argmax_drafts, rejection_sample
from dsinfer.speculative.verify import judge_batched, speculative_output, verify_sequence
from dsinfer.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import spec_step  # noqa: E402

VOCAB = 40
STOP = 7


def _states(params: list[SamplingParams], outputs: list[list[int]]):
    states = [make_sampling_state(p, [1, 2, 3], STOP) for p in params]
    for state, output in zip(states, outputs, strict=True):
        state.output_token_ids = list(output)
    return states


def _case(seed: int):
    """Logits of 8 sequences with 0-4 drafts, drafts often the argmax (so runs of accepted drafts occur)."""
    generator = torch.Generator().manual_seed(seed)
    counts = [3, 0, 4, 1, 2, 3, 0, 4]
    logits = torch.randn(sum(counts) + len(counts), VOCAB, generator=generator) * 3
    drafts, row = [], 0
    for n in counts:
        argmax = logits[row : row + n].argmax(-1).tolist()  # draft j is judged against row j
        flips = torch.rand(n, generator=generator).tolist()
        drafts.append([a if f < 0.7 else (a + 1) % VOCAB for a, f in zip(argmax, flips, strict=True)])
        row += n + 1
    drafts[3] = [STOP]  # a stop token min_tokens still blocks
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0.9, seed=1),
        SamplingParams(temperature=0.8, top_p=0.9, seed=2, logprobs=0),
        SamplingParams(temperature=0, min_tokens=5),
        SamplingParams(temperature=1.0, top_k=5, min_p=0.05, seed=3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0.7, seed=4, min_tokens=3, logprobs=1),
    ]
    outputs = [[5], [], [9, 9], [4], [], [1, 2], [3], [8]]
    first_rows = [sum(c + 1 for c in counts[:i]) for i in range(len(counts))]
    return logits, drafts, params, outputs, first_rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_judging_emits_what_judging_each_sequence_alone_emits(seed):
    logits, drafts, params, outputs, first_rows = _case(seed)
    batched = judge_batched(logits, first_rows, drafts, _states(params, outputs))
    alone_states, sampler = _states(params, outputs), Sampler()
    accepted_somewhere = 0
    for b, (state, d) in enumerate(zip(alone_states, drafts, strict=True)):
        rows = logits[first_rows[b] : first_rows[b] + len(d) + 1]
        if d:
            tokens, _ = verify_sequence(rows, d, state)
            expected = speculative_output(rows, tokens, d, state)
        else:
            expected = sampler(rows, [state])[0]
        got = batched[b]
        assert got.token_ids == expected.token_ids, f"sequence {b}"
        assert got.num_accepted == len(expected.token_ids) - 1 and got.num_drafts == len(d)
        accepted_somewhere += got.num_accepted > 0
        if expected.logprobs is None:
            assert got.logprobs is None and got.top_logprobs is None
        else:
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(expected.logprobs))
            assert [[i for i, _ in row] for row in got.top_logprobs] == [[i for i, _ in row]
                                                                       for row in expected.top_logprobs]  # fmt: skip
    assert accepted_somewhere >= 2
    assert batched[3].token_ids[0] != STOP  # min_tokens: the stop-token draft is never accepted


def test_ragged_argmax_acceptance_keeps_the_target_distribution():
    trials, vocab = 200_000, 6
    generator = torch.Generator().manual_seed(5)
    p = torch.rand(3, vocab, generator=generator).pow(2) + 0.02
    draft = p.argmax(-1)[:2]
    num_drafts = torch.randint(0, 3, (trials,), generator=generator)  # 0, 1 or 2 drafts per sequence
    uniforms = torch.rand(trials, 2, generator=generator)
    noise = -torch.rand(trials, vocab, generator=generator).log()
    accepted, last = accept_argmax_drafts(p.expand(trials, -1, -1), draft.expand(trials, -1), num_drafts, uniforms,
                                          noise)  # fmt: skip
    assert bool((accepted <= num_drafts).all())
    first = torch.where(accepted > 0, draft[0], last)
    for count in range(3):  # the first token follows p[0] whatever the draft count
        counts = torch.bincount(first[num_drafts == count], minlength=vocab).double()
        expected = p[0].double() / p[0].sum() * counts.sum()
        assert float(((counts - expected) ** 2 / expected).sum()) < 20.52  # chi-square, 5 dof, 0.999
    # With two drafts each and the same randomness, the batched acceptance is the dense one's.
    both = torch.full((trials,), 2)
    dense = rejection_sample(p.expand(trials, -1, -1), draft.expand(trials, -1), uniforms, noise)
    ragged = accept_argmax_drafts(p.expand(trials, -1, -1), draft.expand(trials, -1), both, uniforms, noise)
    assert float((dense[0] == ragged[0]).double().mean()) > 0.9999
    assert float((dense[1] == ragged[1]).double().mean()) > 0.9999


class GatheredMoE:
    """The routed experts without the reference's per-expert host loop (the GPU backends never read the host):
    every expert dequantized once, each token's picked experts gathered."""

    def __init__(self, weights: ExpertWeights, dtype: torch.dtype) -> None:
        pairs = [dequantize_expert(weights, e, dtype) for e in range(weights.num_experts)]
        self.w13, self.w2 = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        self.inter = weights.intermediate_size

    def routed_moe(self, x, weights, expert_ids, expert_weights, swiglu_limit):
        hidden = torch.einsum("th,tkoh->tko", x, self.w13[expert_ids])
        gate = hidden[..., : self.inter].clamp(max=swiglu_limit)
        up = hidden[..., self.inter :].clamp(min=-swiglu_limit, max=swiglu_limit)
        out = torch.einsum("tki,tkhi->tkh", torch.nn.functional.silu(gate) * up, self.w2[expert_ids])
        return (out * expert_weights[..., None].to(x.dtype)).sum(dim=1)


def _host_reads_per_step(model, tokenizer, method: str, sequences: int, k: int, greedy: bool = False,
                         graph_sizes: tuple[int, ...] | None = None, sampled_only: bool = False) -> dict:  # fmt: skip
    saved = {}
    dtype = model.embed.weight.dtype
    for module in model.modules():
        if isinstance(module, MoE):
            saved[module], module.ops = module.ops, GatheredMoE(module.routed_weights(), dtype)
    try:
        config = EngineConfig(max_num_seqs=sequences, max_num_batched_tokens=512, max_model_len=120,
                              speculative_config={"method": method, "num_speculative_tokens": k},
                              cuda_graph_sizes=graph_sizes)  # fmt: skip
        engine = LLMEngine(model, tokenizer, config)
        prompts = random_prompts(sequences, seed=sequences, low=20, high=30)
        for i, prompt in enumerate(prompts):  # greedy, seeded sampling, logprobs, min_tokens
            params = SamplingParams(temperature=0.8 * (i % 2), seed=i, logprobs=2 if i % 3 else None, min_tokens=4,
                                    max_tokens=60, ignore_eos=True)  # fmt: skip
            if sampled_only:  # seeded and unseeded sampling, top-k / top-p, min_tokens: no logprobs
                params = SamplingParams(temperature=0.8, seed=i if i % 2 else None, top_k=5 * (i % 3), min_tokens=30,
                                        top_p=0.9 if i % 2 else 1.0, max_tokens=60)  # fmt: skip
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True) if greedy else
                               params)  # fmt: skip
        for _ in range(3):
            engine.step()
        assert all(seq.draft_token_ids for seq in engine.scheduler.running)
        clock, counter = spec_step.PhaseClock(engine.worker.speculative), spec_step.HostReadCounter()
        clock.counter = counter
        reads = []
        for _ in range(3):
            counter.counts.clear()
            with counter:
                engine.step()
            reads.append(sum(counter.counts[phase] for phase in spec_step.PHASES))
        executor = engine.worker.speculative
        return {"reads": reads, "drafts": engine.spec_stats.num_draft_tokens, "graphed": executor.graphed_steps}
    finally:
        for module, ops in saved.items():
            module.ops = ops


@pytest.mark.parametrize("sequences", [1, 5])
def test_a_v4_verify_step_reads_the_host_twice_whatever_the_batch(tiny_v4_model, tiny_v4_tokenizer, sequences):
    result = _host_reads_per_step(tiny_v4_model, tiny_v4_tokenizer, "mtp", sequences, 3)
    assert result["reads"] == [2, 2, 2] and result["drafts"] > 0  # the judged tokens, then the next drafts


def test_a_v41_verify_step_reads_the_host_twice_whatever_the_batch(tiny_v41_checkpoint):
    model = load_model(tiny_v41_checkpoint, progress=False).set_fake_quantization(False)
    tokenizer = Tokenizer.from_dir(tiny_v41_checkpoint)
    result = _host_reads_per_step(model, tokenizer, "dspark", 5, 2)
    assert result["reads"] == [2, 2, 2] and result["drafts"] > 0


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_a_graphed_greedy_verify_step_reads_the_host_once(tiny_v4_model, tiny_v4_tokenizer, tiny_v41_checkpoint,
                                                          method):  # fmt: skip
    """Snapshot, judge, rollback and drafts run in the bucket's static path; the host reads the step's result once
    (a sampled or logprobs request adds the host judge's read)."""
    if method == "mtp":
        model, tokenizer = tiny_v4_model, tiny_v4_tokenizer
    else:
        model = load_model(tiny_v41_checkpoint, progress=False).set_fake_quantization(False)
        tokenizer = Tokenizer.from_dir(tiny_v41_checkpoint)
    result = _host_reads_per_step(model, tokenizer, method, 3, 3, greedy=True, graph_sizes=(4,))
    assert result["reads"] == [1, 1, 1] and result["drafts"] > 0 and result["graphed"] >= 3
    result = _host_reads_per_step(model, tokenizer, method, 3, 3, graph_sizes=(4,))
    assert result["reads"] == [2, 2, 2] and result["graphed"] >= 3


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_a_graphed_sampled_verify_step_reads_the_host_once(tiny_v4_model, tiny_v4_tokenizer, tiny_v41_checkpoint,
                                                           method):  # fmt: skip
    """Sampled requests (and min_tokens masks) are judged on the device between the verify and draft replays."""
    if method == "mtp":
        model, tokenizer = tiny_v4_model, tiny_v4_tokenizer
    else:
        model = load_model(tiny_v41_checkpoint, progress=False).set_fake_quantization(False)
        tokenizer = Tokenizer.from_dir(tiny_v41_checkpoint)
    result = _host_reads_per_step(model, tokenizer, method, 3, 3, graph_sizes=(4,), sampled_only=True)
    assert result["reads"] == [1, 1, 1] and result["drafts"] > 0 and result["graphed"] >= 3
