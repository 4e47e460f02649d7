"""The device judge of a graphed verify step gives the host judge's tokens, sampled requests included.

:class:`~dsinfer.speculative.fixed_judge.FixedJudge` judges sampled and ``min_tokens`` sequences from input
tensors, keying its noise on the device; it must emit exactly what the host's batched judge
(:func:`~dsinfer.speculative.verify.judge_batched`) emits from the same logits (the same seeds, the same noise
keys), for one sequence and for a batch, with filler drafts and padding rows. Engine runs compare a graphed step
judged on the device with the same graphed step judged on the host (the logits are the same, so every token must
be), for MTP and DSpark at K = 1, 3, 5 on batches mixing greedy and sampled requests.
"""

from __future__ import annotations

import pytest
import torch
from engine_harness import random_prompts, run_all, use_oracle_drafts
from test_spec_dspark import checkpoint  # noqa: F401 (a fixture: V4.1 with DSpark blocks of 5)
from test_spec_dspark import model as dspark_model  # noqa: F401 (a fixture, over it)
from test_spec_dspark import tokenizer as dspark_tokenizer  # noqa: F401 (a fixture)

from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.sampling.noise import (
    ACCEPT_STREAM,
    RACE_STREAM,
    as_int64,
    mix64,
    mix64_tensor,
    noise_key,
    position_keys,
    stream_key,
)
from dsinfer.sampling.sampler import make_sampling_state
from dsinfer.sampling_params import SamplingParams
from dsinfer.speculative.fixed_judge import FixedJudge, JudgeMode
from dsinfer.speculative.verify import judge_batched

VOCAB = 40
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
STOP = 7

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_device_keys_are_the_hosts():
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(-(2**62), 2**62, (64,), generator=generator) * 2 + 1
    assert mix64_tensor(values).tolist() == [as_int64(mix64(v % 2**64)) for v in values.tolist()]
    cases = [(0, 0, 0), (-5, 2, 7), (2**70 + 3, 1, 10**6), (2**63 + 11, 0, 4095)]
    for seed, index, position in cases:
        for stream in (RACE_STREAM, ACCEPT_STREAM):
            key = position_keys(torch.tensor([as_int64(stream_key(seed, index, stream))]), torch.tensor([position]))
            assert key.tolist() == [as_int64(noise_key(seed, index, position, stream))]


def _params(seed: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.3, seed=seed),  # peaked: its argmax drafts are mostly accepted
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=seed + 1),
        SamplingParams(temperature=0, min_tokens=5),
        SamplingParams(temperature=1.0, top_k=5, min_p=0.05, seed=seed + 2),
        SamplingParams(temperature=0.7, min_tokens=3),  # unseeded: a random seed both judges read
        SamplingParams(temperature=1.3, top_k=3, top_p=0.8, seed=seed + 3, min_tokens=9),
    ]


def _fixed_case(seed: int, width: int):
    """A bucket of 8 rows (7 sequences, one padding row) of ``width`` positions: logits, drafts (often the argmax,
    sometimes a stop token), the real draft counts (the rest filler) and the states."""
    generator = torch.Generator().manual_seed(seed)
    params = _params(seed)
    size = len(params) + 1
    logits = torch.randn(size * width, VOCAB, generator=generator) * 4
    argmax = logits.view(size, width, VOCAB).argmax(-1)[:, : width - 1]
    flips = torch.rand(size, width - 1, generator=generator) < 0.25
    flips[0] = False
    draft_ids = torch.where(flips, (argmax + 1) % VOCAB, argmax)
    draft_ids[3, 0], draft_ids[5, min(1, width - 2)] = STOP, STOP  # drafts min_tokens blocks
    counts = torch.randint(0, width, (size,), generator=generator)
    counts[:3] = width - 1
    outputs = [[5], [], [9, 9], [4], [], [1, 2], [3, 3, 3]]
    states = [make_sampling_state(p, [1, 2, 3], STOP) for p in params]
    for state, output in zip(states, outputs, strict=True):
        state.output_token_ids = list(output)
    return logits, draft_ids, counts, states, size


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("width", [2, 4, 6])
def test_the_device_judge_emits_the_host_judges_tokens(seed, width, device):
    logits, draft_ids, counts, states, size = _fixed_case(seed, width)
    logits, draft_ids, counts = logits.to(device), draft_ids.to(device), counts.to(device)
    judge = FixedJudge(size, torch.device(device))
    mode = judge.plan(states, size, width)
    assert mode is JudgeMode.FILTERED_TOP
    accepted, last = judge.judge(logits, draft_ids, counts, mode)
    drafts = [draft_ids[b, : counts[b]].tolist() for b in range(len(states))]
    expected = judge_batched(logits, [b * width for b in range(len(states))], drafts, states)
    got = [(int(a), int(t)) for a, t in zip(accepted[: len(states)], last[: len(states)], strict=True)]
    assert got == [(out.num_accepted, out.token_ids[-1]) for out in expected]
    assert any(got[b][0] for b in (0, 2, 4, 6))  # sampled sequences accepted drafts
    # Without the top-k / top-p requests the cheaper mode judges the rest alike.
    kept = [0, 1, 3, 5]
    mode = judge.plan([states[b] for b in kept], size, width)
    assert mode is JudgeMode.FILTERED
    rows = torch.tensor(kept + [7] * (size - len(kept)), device=device)
    fixed = logits.view(size, width, VOCAB)[rows].flatten(0, 1)
    accepted, last = judge.judge(fixed, draft_ids[rows], counts[rows], mode)
    expected = judge_batched(fixed, [b * width for b in range(len(kept))], [drafts[b] for b in kept],
                             [states[b] for b in kept])  # fmt: skip
    assert [(int(a), int(t)) for a, t in zip(accepted[: len(kept)], last[: len(kept)], strict=True)] == [
        (out.num_accepted, out.token_ids[-1]) for out in expected
    ]


def test_only_requests_the_device_cannot_judge_go_to_the_host():
    judge = FixedJudge(4, torch.device("cpu"))
    greedy = make_sampling_state(SamplingParams(temperature=0), [1], STOP)
    assert judge.plan([greedy], 4, 3) is JudgeMode.ARGMAX
    for params in (SamplingParams(temperature=0.5, logprobs=1), SamplingParams(repetition_penalty=1.2),
                   SamplingParams(temperature=0, stop_token_ids=list(range(20, 30)), min_tokens=2)):  # fmt: skip
        assert judge.plan([greedy, make_sampling_state(params, [1], STOP)], 4, 3) is None
    done = make_sampling_state(SamplingParams(temperature=0, stop_token_ids=list(range(20, 30))), [1], STOP)
    assert judge.plan([greedy, done], 4, 3) is JudgeMode.ARGMAX  # no min_tokens: its stop ids are not masked


# ---- engine runs: the device judge against the host judge on the same graphed steps ------------------------------


# Low temperatures: plain sampling's tokens, the oracle's drafts, are then often accepted.
PARAMS = [SamplingParams(temperature=0.05, seed=11, max_tokens=14, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.1, top_k=8, top_p=0.9, seed=12, max_tokens=13, min_tokens=6),
          SamplingParams(temperature=0.6, min_p=0.1, seed=13, max_tokens=10, ignore_eos=True)]  # fmt: skip


def _run(model, tokenizer, prompts, spec: dict | None = None, on_device: bool = True, references=None):
    """Each request's tokens, and the judge modes of the graphed steps (None: judged on the host)."""
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160, speculative_config=spec,
                          cuda_graph_sizes=(1, 2, 4) if spec else None)  # fmt: skip
    engine = LLMEngine(model, tokenizer, config)
    if spec is None:
        return [out.outputs[0].token_ids for out in run_all(engine, prompts, PARAMS)], []
    use_oracle_drafts(engine, references)  # drafts that are often accepted: plain sampling's tokens
    graphs, modes = engine.worker.speculative.graphs, []
    plan = graphs.judge.plan

    def planning(states, size, width):
        mode = plan(states, size, width) if on_device else None
        modes.append(mode)
        return mode

    graphs.judge.plan = planning
    tokens = [out.outputs[0].token_ids for out in run_all(engine, prompts, PARAMS)]
    assert engine.spec_stats.num_accepted_tokens > 0  # drafts were accepted, not only correction tokens emitted
    return tokens, modes


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_graphed_sampled_decoding_judged_on_the_device_equals_the_host_judge(request, method, k):
    if method == "mtp":
        model, tokenizer = request.getfixturevalue("tiny_v4_model"), request.getfixturevalue("tiny_v4_tokenizer")
    else:  # V4.1 with DSpark blocks of 5
        model, tokenizer = request.getfixturevalue("dspark_model"), request.getfixturevalue("dspark_tokenizer")
    prompts = random_prompts(4, seed=k, low=20, high=40)
    plain, _ = _run(model, tokenizer, prompts)
    references = {f"req-{i}": tokens for i, tokens in enumerate(plain)}
    spec = {"method": method, "num_speculative_tokens": k}
    device, modes = _run(model, tokenizer, prompts, spec, True, references)
    host, host_modes = _run(model, tokenizer, prompts, spec, False, references)
    assert device == host
    assert JudgeMode.FILTERED_TOP in modes and set(host_modes) == {None}  # both judges really ran
