"""``kv_cache_dtype``: V4's indexer keys as FP8 codes with per-block ue8m0 scales, chosen by the engine option.

FP8 keys are rounded (three mantissa bits), so the indexer's top-k may change where two entries' scores lie
within the rounding of each other. The tests bound that rounding per score and hold the FP8 engine to the
model-dtype engine wherever every choice a prompt made is further from a tie than the bound: there the choices,
and so the greedy tokens, must be equal.
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_harness import random_prompts, run_all

from dsinfer.bench import sweep, sweep_options
from dsinfer.cli import main
from dsinfer.config import ConfigError, EngineConfig
from dsinfer.engine.cache_plan import cache_blocks_for_budget
from dsinfer.engine.engine import LLMEngine
from dsinfer.kv.codecs import INDEX_KEY_FP8_FORMAT, index_key_fp8_format
from dsinfer.layers.indexer import Indexer
from dsinfer.llm import LLM
from dsinfer.models.served import CachePlan
from dsinfer.sampling_params import SamplingParams
from dsinfer.server import launch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = {"max_num_seqs": 8, "max_num_batched_tokens": 48, "max_model_len": 160}
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class RecordingOps:
    """An indexer's op table that records every top-k choice it makes and how far that choice is from a tie,
    measured against the most FP8 rounding of the keys can move a score."""

    def __init__(self, ops, log: list) -> None:
        self._ops, self._log = ops, log

    def __getattr__(self, name: str):
        return getattr(self._ops, name)

    def index_scores(self, q, keys, head_weights, visible):
        scores = self._ops.index_scores(q, keys, head_weights, visible)
        self._record(q, keys, head_weights, scores)
        return scores

    def indexer_topk_decode(self, inputs, k):
        chosen = self._ops.indexer_topk_decode(inputs, k)
        keys = inputs.gathered_keys()
        scores = self._ops.index_scores(inputs.q, keys, inputs.head_weights, inputs.visible)
        self._record(inputs.q, keys, inputs.head_weights, scores, chosen)
        return chosen

    def index_topk_decode(self, scores, k):
        chosen = self._ops.index_topk_decode(scores, k)
        self._log[-1]["chosen"] = chosen
        return chosen

    def _record(self, q, keys, head_weights, scores, chosen=None) -> None:
        """Whether each row's choice is further from a tie than FP8 rounding of the keys can reach: rounding moves
        entry w's score by at most ``b_w = sum_h |w_h| * |q_h . (k_w - round(k_w))| / sqrt(d)`` (ReLU moves a
        product no further), so the k best stay the k best where the worst of them, less its b, beats the best of
        the rest, plus its b."""
        fmt = index_key_fp8_format(keys.shape[-1])
        error = keys.float() - fmt.decode(*fmt.encode(keys.float()), torch.float32)
        spec = "nhd,wd->nhw" if keys.dim() == 2 else "nhd,nwd->nhw"
        moved = torch.einsum(spec, q.float(), error).abs() * head_weights.float().abs().unsqueeze(-1)
        bound = moved.sum(dim=1) * q.shape[-1] ** -0.5 * 1.01 + 1e-6  # [n, W], a margin for float32's own rounding
        k = self.topk
        best = scores.topk(min(k, scores.shape[1]), dim=1).indices
        kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best, True) & scores.isfinite()
        rest = ~kept & scores.isfinite()
        lowest_kept = torch.where(kept, scores - bound, float("inf")).amin(dim=1)
        highest_rest = torch.where(rest, scores + bound, float("-inf")).amax(dim=1)
        self._log.append({"untied": lowest_kept > highest_rest, "contested": rest.any(dim=1), "chosen": chosen})


def _record_choices(model) -> list:
    """Swap every V4 indexer's op table for a recording one; returns the shared log (undo with the returned list's
    ``restore``)."""
    log: list = []
    swapped = []
    for module in model.modules():
        if isinstance(module, Indexer):
            recorder = RecordingOps(module.ops, log)
            recorder.topk = module.topk
            swapped.append((module, module.ops))
            module.ops = recorder
    return log, swapped


def _restore(swapped) -> None:
    for module, ops in swapped:
        module.ops = ops


def _same_choice(plain, coded, rows: torch.Tensor) -> bool:
    """A decode step's (chosen, real) pair or a prefill's chosen entries, equal in ``rows``."""
    if isinstance(plain, tuple):
        return all(torch.equal(a[rows], b[rows]) for a, b in zip(plain, coded, strict=True))
    return torch.equal(plain[rows], coded[rows])


def _alone(model, tokenizer, prompt, kv_cache_dtype: str) -> tuple[list[int], list]:
    """One prompt's greedy tokens in an engine of its own, with every index choice it made recorded."""
    log, swapped = _record_choices(model)
    try:
        engine = LLMEngine(model, tokenizer, EngineConfig(**BASE, kv_cache_dtype=kv_cache_dtype))
        tokens = run_all(engine, [prompt], GREEDY)[0].outputs[0].token_ids
    finally:
        _restore(swapped)
    return tokens, log


def test_fp8_index_keys_choose_as_bf16_away_from_ties(tiny_v4_model, tiny_v4_tokenizer):
    """Both runs of a prompt score the same queries against the same keys (rounded or not) until a choice differs;
    up to the first choice near a tie (that one's untied rows included) every untied row must choose the same
    entries, and a prompt none of whose choices is near a tie must give the same tokens. The tiny model's scores
    lie close together (8 heads of 32 channels), so short prompts keep some prompts clear of ties."""
    model, tokenizer = tiny_v4_model, tiny_v4_tokenizer
    prompts = random_prompts(16, seed=3, low=16, high=26)
    untied_prompts, compared = [], 0
    for index, prompt in enumerate(prompts):
        plain_tokens, plain_log = _alone(model, tokenizer, prompt, "auto")
        coded_tokens, coded_log = _alone(model, tokenizer, prompt, "fp8")
        for plain, coded in zip(plain_log, coded_log, strict=True):
            rows = plain["untied"]
            assert _same_choice(plain["chosen"], coded["chosen"], rows)
            compared += int((rows & plain["contested"]).sum())
            if not rows.all():
                break
        else:
            assert coded_tokens == plain_tokens
            untied_prompts.append(index)
    assert len(untied_prompts) >= 2 and compared >= 50  # real choices compared, not only uncontested ones

    batched = LLMEngine(model, tokenizer, EngineConfig(**BASE, kv_cache_dtype="fp8"))
    outputs = run_all(batched, [prompts[i] for i in untied_prompts], GREEDY)
    expected = [_alone(model, tokenizer, prompts[i], "auto")[0] for i in untied_prompts]
    assert [out.outputs[0].token_ids for out in outputs] == expected
    indexer_cache = batched.runner.cache.layers[1].indexer
    assert indexer_cache.entries.dtype == torch.float8_e4m3fn and indexer_cache.entry_scales.dtype == torch.uint8


def test_fp8_index_keys_shrink_every_block_and_more_blocks_fit(tiny_v4_model):
    model, config = tiny_v4_model, tiny_v4_model.config
    block_tokens = model.cache_block_tokens(None)
    plain = model.build_cache(CachePlan(0, 0, block_tokens, "meta"))
    coded = model.build_cache(CachePlan(0, 0, block_tokens, "meta", kv_cache_dtype="fp8"))
    csa_layers = sum(ratio == config.csa_ratio for ratio in config.compress_ratios)
    keys_per_block = csa_layers * block_tokens // config.csa_ratio
    dim = config.index_head_dim  # fp32 on the CPU: 4 bytes a channel, against one code byte and one scale a key
    assert plain.block_bytes() - coded.block_bytes() == keys_per_block * (4 * dim - (dim + 1))
    assert coded.slot_bytes() == plain.slot_bytes()
    budget = {"num_cache_blocks": None, "cache_memory_bytes": 2**20}
    blocks = {name: cache_blocks_for_budget(model, EngineConfig(kv_cache_dtype=name, **budget), 4, block_tokens)
              for name in ("auto", "bf16", "fp8")}  # fmt: skip
    assert blocks["auto"] == blocks["bf16"] < blocks["fp8"]
    # the release's 128-channel keys: 129 bytes a key (128 codes, one ue8m0 byte) against bf16's 256
    assert INDEX_KEY_FP8_FORMAT.row_bytes(128) == 129 and index_key_fp8_format(128) is INDEX_KEY_FP8_FORMAT


def test_fp8_index_keys_decode_exactly_to_bf16_for_bf16_queries(tiny_checkpoint, tiny_v4_tokenizer):
    """A prefill scores FP8 keys decoded to bf16 beside bf16 queries (the tensor cores' operands; float32 keys take
    IEEE products on the CUDA cores): every e4m3 code times its ue8m0 scale is a bf16 value, so the keys are the
    float32 decode's, bit for bit. Other dtypes are refused."""
    from dsinfer.models.loader import load_model

    model = load_model(tiny_checkpoint, dtype=torch.bfloat16, progress=False)
    seen: list[torch.dtype] = []
    for module in model.modules():
        if isinstance(module, Indexer):
            scores = module.ops.index_scores

            class Spy:  # the indexer's table, recording the keys' dtype of every prefill scoring
                def __getattr__(self, name, ops=module.ops):
                    return getattr(ops, name)

                def index_scores(self, q, keys, head_weights, visible, scores=scores):
                    seen.append(keys.dtype)
                    return scores(q, keys, head_weights, visible)

            module.ops = Spy()
    engine = LLMEngine(model, tiny_v4_tokenizer, EngineConfig(**BASE, kv_cache_dtype="fp8"))
    run_all(engine, random_prompts(1, seed=2, low=40, high=41), GREEDY)
    assert seen and set(seen) == {torch.bfloat16}
    cache = engine.runner.cache.layers[1].indexer
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(6, cache.entries.shape[-1], generator=generator) * torch.logspace(-6, 6, 6)[:, None]
    blocks, offsets = torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([0, 1, 0, 1, 0, 1])
    cache.store_rows(blocks, offsets, rows)
    wide = cache.load_rows(blocks, offsets)
    assert torch.equal(cache.load_rows(blocks, offsets, decoded=torch.bfloat16).float(), wide)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cache.load_rows(blocks, offsets, decoded=torch.float16)


def test_forks_and_drafts_carry_the_scales(tiny_v4_model, tiny_v4_tokenizer):
    model, tokenizer = tiny_v4_model, tiny_v4_tokenizer
    prompt = random_prompts(1, seed=5, low=60, high=61)[0]
    alone = LLMEngine(model, tokenizer, EngineConfig(**BASE, kv_cache_dtype="fp8"))
    expected = run_all(alone, [prompt], GREEDY)[0].outputs[0].token_ids

    forked = LLMEngine(model, tokenizer, EngineConfig(**BASE, kv_cache_dtype="fp8"))
    source = forked.add_request(prompt, GREEDY)
    while len(forked.requests[source][0].output_token_ids) < 2:
        forked.step()
    forked.settle()
    clone = forked.fork_request(source, GREEDY)
    results = {}
    while forked.has_unfinished_requests():
        results.update({out.request_id: out for out in forked.step() if out.finished})
    assert results[source].outputs[0].token_ids == expected
    assert results[clone].outputs[0].token_ids[:8] == expected[:8]

    spec = {"method": "mtp", "num_speculative_tokens": 3}
    drafted = LLMEngine(model, tokenizer, EngineConfig(**BASE, kv_cache_dtype="fp8", speculative_config=spec))
    assert run_all(drafted, [prompt], GREEDY)[0].outputs[0].token_ids == expected
    assert drafted.spec_stats.num_draft_tokens > 0


def test_a_bad_value_names_the_flag(tiny_checkpoint, capsys):
    with pytest.raises(ConfigError, match=r"'kv_cache_dtype' \(--kv-cache-dtype\): expected one of auto, bf16, fp8"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLM(tiny_checkpoint, kv_cache_dtype="float8")
    with pytest.raises(SystemExit):
        main(["serve", str(tiny_checkpoint), "--kv-cache-dtype", "fp16"])
    assert "--kv-cache-dtype: invalid choice: 'fp16'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        sweep_options.parse_args(["decode", "--kv-cache-dtype", "int8"])
    assert "--kv-cache-dtype: invalid choice: 'int8'" in capsys.readouterr().err


def test_serve_and_llm_take_the_option(tiny_checkpoint, monkeypatch):
    launched = {}
    monkeypatch.setattr(launch, "serve", lambda options, engine: launched.update(engine=engine) or 0)
    assert main(["serve", str(tiny_checkpoint), "--kv-cache-dtype", "fp8"]) == 0
    assert launched["engine"].kv_cache_dtype == "fp8"
    assert main(["serve", str(tiny_checkpoint)]) == 0
    assert launched["engine"].kv_cache_dtype == "auto"

    with LLM(tiny_checkpoint, kv_cache_dtype="fp8", max_model_len=64) as llm:
        cache = llm.engine.runner.cache
        assert cache.layers[1].indexer.entries.dtype == torch.float8_e4m3fn
        out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4


def test_the_sweep_runs_with_fp8_index_keys(tmp_path):
    argv = ["decode", "--points", "2", "--context", "48", "--device", "cpu", "--warmup-steps", "1",
            "--measure-steps", "2", "--tag", "fp8", "--out-root", str(tmp_path), "--kv-cache-dtype", "fp8",
            "--telemetry-interval", "0"]  # fmt: skip
    assert sweep_options.parse_args(argv).kv_cache_dtype == "fp8"
    assert sweep.main(argv) == 0
    record = json.loads((tmp_path / "fp8" / "results.jsonl").read_text().splitlines()[0])
    assert record["engine"]["kv_cache_dtype"] == "fp8" and record["cache"]["storage"] == "fp8"
