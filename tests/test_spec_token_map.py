"""MTP drafts limited to a ``draft_token_map`` (the token ids the drafter may propose; each draft reads only their
rows of the head): plain decoding's greedy tokens still, eager and in graph buckets; every draft from the map; a
map of every id drafts what no map drafts; and each wrong map refused with the field and the reason."""

from __future__ import annotations

import json

import pytest
import torch
from engine_harness import random_prompts, run_all

from dsinfer.config import ConfigError, EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.sampling_params import SamplingParams
from dsinfer.speculative.mtp import MTPDrafter

BASE = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 160}
PROMPTS = random_prompts(4, seed=11, low=40, high=60)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _engine(model, tokenizer, token_map: str | None, **options) -> LLMEngine:
    spec = None if token_map is None else {"method": "mtp", "num_speculative_tokens": 3, "draft_token_map": token_map}
    return LLMEngine(model, tokenizer, EngineConfig(**{**BASE, **options}, speculative_config=spec))


def _map_file(tmp_path, ids) -> str:
    path = tmp_path / "map.json"
    path.write_text(json.dumps(ids))
    return str(path)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buckets"])
def test_drafts_from_a_token_map_keep_plain_decodings_tokens(tiny_v4_model, tiny_v4_tokenizer, tmp_path, graphs):
    options = {"cuda_graph_sizes": [4]} if graphs else {}
    plain = [out.outputs[0].token_ids for out in run_all(_engine(tiny_v4_model, tiny_v4_tokenizer, None), PROMPTS,
                                                         GREEDY)]  # fmt: skip
    vocab = tiny_v4_model.config.vocab_size
    allowed = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[: vocab // 3].tolist()
    engine = _engine(tiny_v4_model, tiny_v4_tokenizer, _map_file(tmp_path, allowed), **options)
    drafter = engine.worker.speculative.drafter
    drafted = []
    choose = drafter._draft_tokens

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        tokens = choose(hidden)
        drafted.append(tokens.clone())
        return tokens

    drafter._draft_tokens = recorded
    got = [out.outputs[0].token_ids for out in run_all(engine, PROMPTS, GREEDY)]
    assert got == plain
    assert drafted and set(torch.cat(drafted).tolist()) <= set(allowed)
    assert engine.spec_stats.num_draft_tokens > 0 and engine.blocks.num_used == 0
    assert (engine.worker.speculative.graphed_steps > 0) == graphs


def test_a_map_of_every_id_drafts_what_no_map_drafts(tiny_v4_model, tiny_v4_tokenizer):
    spec = {"method": "mtp", "num_speculative_tokens": 3}  # a cache with the MTP layer's ring
    engine = LLMEngine(tiny_v4_model, tiny_v4_tokenizer, EngineConfig(**BASE, speculative_config=spec))
    cache, vocab = engine.runner.cache, tiny_v4_model.config.vocab_size
    everything = torch.randperm(vocab, generator=torch.Generator().manual_seed(1)).tolist()
    hidden = torch.randn(7, tiny_v4_model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    full = MTPDrafter(tiny_v4_model, cache, 3)._draft_tokens(hidden)
    assert torch.equal(MTPDrafter(tiny_v4_model, cache, 3, everything)._draft_tokens(hidden), full)
    top = tiny_v4_model.head(hidden).float().topk(2, dim=-1).indices
    without_best = [i for i in everything if i not in set(top[:, 0].tolist())]
    assert torch.equal(MTPDrafter(tiny_v4_model, cache, 3, without_best)._draft_tokens(hidden), top[:, 1])


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot be read"),
    ("[1, 2", "not valid JSON"),
    ("{}", "expected a non-empty JSON array of token ids"),
    ("[]", "expected a non-empty JSON array of token ids"),
    ("[1, -2]", "every entry must be a non-negative integer token id"),
    ("[1, true]", "every entry must be a non-negative integer token id"),
    ("[1, 2.5]", "every entry must be a non-negative integer token id"),
    ("[3, 4, 3]", "token ids repeat"),
])  # fmt: skip
def test_a_wrong_map_file_is_refused_with_the_field_and_the_reason(tmp_path, content, message):
    path = tmp_path / "map.json"
    if content is not None:
        path.write_text(content)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "draft_token_map": str(path)}
    with pytest.raises(ConfigError, match=rf"speculative_config 'draft_token_map' \(.*map.json\): {message}"):
        EngineConfig(speculative_config=spec)


def test_a_map_is_refused_for_dspark_and_outside_the_vocabulary(tiny_v4_model, tiny_v4_tokenizer, tmp_path):
    spec = {"method": "dspark", "num_speculative_tokens": 2, "draft_token_map": _map_file(tmp_path, [1, 2])}
    with pytest.raises(ConfigError, match="'draft_token_map': only 'mtp' drafts read the head once a draft"):
        EngineConfig(speculative_config=spec)
    vocab = tiny_v4_model.config.vocab_size
    outside = _map_file(tmp_path, [0, vocab])
    with pytest.raises(ConfigError, match=f"token id {vocab} is outside the model's vocabulary of {vocab}"):
        _engine(tiny_v4_model, tiny_v4_tokenizer, outside)


def test_the_map_script_ranks_a_corpus_and_keeps_the_special_tokens(tiny_checkpoint, tiny_v4_tokenizer, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    corpus = tmp_path / "traffic.txt"
    corpus.write_text("the cat sat on the mat. the end.\n" * 3 + "rare words once\n", encoding="utf-8")
    out = tmp_path / "map.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "make_token_map.py"
    done = subprocess.run([sys.executable, str(script), "--model", str(tiny_checkpoint), "--corpus", str(corpus),
                           "--size", "5", "--out", str(out)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    ids = json.loads(out.read_text())
    counts = {}
    for token in tiny_v4_tokenizer.encode(corpus.read_text(encoding="utf-8")):
        counts[token] = counts.get(token, 0) + 1
    ranked = sorted(counts, key=lambda token: (-counts[token], token))[:5]
    assert ids[:5] == ranked and set(ids[5:]) == set(tiny_v4_tokenizer.special_ids) - set(ranked)
    EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 2, "draft_token_map": str(out)})
