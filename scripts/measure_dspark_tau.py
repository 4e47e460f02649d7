"""τ of a V4.1 checkpoint's DSpark draft stages: tokens per verify step with K drafts, on held-out chats.

    python scripts/measure_dspark_tau.py                     # the embedded default
    python scripts/measure_dspark_tau.py --model ./default-v41 --chats 12

For each held-out chat (arithmetic, tools, extraction, greetings, unknown; both thinking modes) the target
first writes its own greedy reply (full recompute per token, in float32 on the CPU); then at every position of
that reply the draft stages draft a block from the target's captured hiddens, and the leading drafts equal to
the target's next greedy tokens are what a greedy verifier accepts (:func:`draft_block_logits`). With K drafts a
verify step yields ``1 + min(accepted, K)`` tokens; τ(K) is its mean over the positions. This is the draft
quality alone: the confidence head's choice of how many drafts to verify is not applied.

A greedy verifier does not visit every position: a round that accepts ``a`` drafts moves ``1 + a`` positions
on, so an easy stretch is a few rounds and a missed stretch one round per token. ``tau_per_round`` walks each
reply as the engine does (first round at the prompt's last position, then ``1 + min(accepted, K)`` on) and
averages over those rounds: that is the engine's τ (tokens per verify round), lower than the mean over
positions.

    python scripts/measure_dspark_tau.py --engine 5:0,5:0.5      # through the engine: K:confidence_threshold

``--engine`` instead serves the same chats' prompts through the engine with ``method: dspark`` (greedy, all
chats in one batch), once per ``K:threshold`` pair, and reports the engine's own counters (the confidence cut
applied): verify rounds (steps of a sequence with drafts), drafts verified and accepted, τ = tokens per verify
round (what ``/metrics`` gives), and tokens per sampling step, which also counts the steps whose drafts the
confidence head cut to none.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from dsinfer.chat.format import ChatFormat
from dsinfer.config import EngineConfig
from dsinfer.engine.engine import LLMEngine
from dsinfer.kv.batch import PackedBatch
from dsinfer.models.loader import load_model
from dsinfer.models.tiny import default_model_dir
from dsinfer.sampling_params import SamplingParams
from dsinfer.tokenizer import EOS_TOKEN, Tokenizer
from dsinfer.training import corpus
from dsinfer.training.draft_loss import draft_block_logits
from dsinfer.training.render import SampleRenderer


def _forward(model, ids: list[int]):
    packed = PackedBatch.from_sequences([ids], "cpu")
    streams, pre_mix, ctx = model.run_layers(packed, capture=True)
    greedy = model.head(model.final_hidden(streams, pre_mix)).argmax(dim=-1)
    targets = torch.cat([ctx.captured[i] for i in model.config.dspark_target_layer_ids], dim=-1)
    return greedy, targets, packed.input_ids


def _greedy_reply(model, prompt: list[int], stop: set[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        token = int(_forward(model, ids)[0][-1])
        ids.append(token)
        if token in stop:
            break
    return ids


def _engine_counters(model, tokenizer, prompts: list[list[int]], k: int, threshold: float, max_tokens: int) -> dict:
    """Greedy replies through the engine with DSpark drafts; the engine's speculative counters."""
    spec = {"method": "dspark", "num_speculative_tokens": k, "confidence_threshold": threshold}
    config = EngineConfig(max_num_seqs=len(prompts), max_model_len=2048, max_num_batched_tokens=2048,
                          speculative_config=spec)  # fmt: skip
    engine = LLMEngine(model, tokenizer, config)
    tokens = 0
    try:
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        while engine.has_unfinished_requests():
            tokens += sum(len(out.outputs[0].token_ids) for out in engine.step() if out.finished)
    finally:
        engine.close()
    stats = engine.spec_stats
    steps = tokens - stats.num_accepted_tokens  # every sampling step emits its accepted drafts and one more token
    return {"k": k, "confidence_threshold": threshold, "tokens": tokens, "sampling_steps": steps,
            "verify_rounds": stats.num_drafts, "drafts_verified": stats.num_draft_tokens,
            "drafts_accepted": stats.num_accepted_tokens, "tau": round(stats.mean_acceptance_length or 1.0, 3),
            "tokens_per_step": round(tokens / steps, 3)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded default)")
    parser.add_argument("--chats", type=int, default=6, help="held-out chats per skill and thinking mode")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--engine", default=None, metavar="K:T,...",
                        help="through the engine, once per K:confidence_threshold pair (e.g. 5:0,5:0.5)")  # fmt: skip
    args = parser.parse_args(argv)
    directory = args.model or str(default_model_dir())
    torch.set_grad_enabled(False)
    model = load_model(directory, progress=False).eval()
    if not len(model.mtp):
        raise SystemExit(f"{directory} has no DSpark draft stages")
    tokenizer = Tokenizer.from_dir(directory)
    renderer = SampleRenderer(ChatFormat(tokenizer, "v41", "default"))
    stop = {tokenizer.token_to_id(EOS_TOKEN), tokenizer.token_to_id("<｜tool▁calls▁end｜>")} - {None}
    size = model.config.dspark_block_size
    if args.engine:
        prompts = [renderer.prompt_ids(sample) for skill in corpus.SKILLS for thinking in (True, False)
                   for sample in corpus.held_out(skill, args.chats, thinking=thinking)]  # fmt: skip
        pairs = [(int(k), float(t)) for k, t in (pair.split(":") for pair in args.engine.split(","))]
        rows = [_engine_counters(model, tokenizer, prompts, k, t, args.max_tokens) for k, t in pairs]
        print(json.dumps({"model": directory, "chats": len(prompts), "engine": rows}, indent=1))
        return 0
    accepted: dict[str, list[int]] = {}
    replies: dict[str, list[list[int]]] = {}  # accepted drafts at each position, one list per reply
    for skill in corpus.SKILLS:
        for thinking in (True, False):
            for sample in corpus.held_out(skill, args.chats, thinking=thinking):
                prompt = renderer.prompt_ids(sample)
                ids = _greedy_reply(model, prompt, stop, args.max_tokens)
                greedy, targets, input_ids = _forward(model, ids)
                padded = torch.cat([input_ids, input_ids.new_full((size,), model.config.dspark_noise_token_id)])
                reply = replies.setdefault(skill, [])
                reply.append([])
                for anchor in range(len(prompt) - 1, len(ids) - 2):
                    logits, _ = draft_block_logits(model, targets, padded, 0, anchor)
                    # the target's greedy tokens after x[p + 1], up to the reply's last token
                    wanted = greedy[anchor + 1 : min(anchor + 1 + size, len(ids) - 1)]
                    right = (logits[: len(wanted)].argmax(dim=-1) == wanted).long().cumprod(dim=0)
                    accepted.setdefault(skill, []).append(int(right.sum()))
                    reply[-1].append(int(right.sum()))
    every = [a for values in accepted.values() for a in values]

    def tau(values: list[int], k: int) -> float:
        return round(1 + sum(min(a, k) for a in values) / len(values), 3)

    def tau_per_round(chats: list[list[int]], k: int) -> float:
        rounds = tokens = 0
        for values in chats:
            position = 0
            while position < len(values):
                step = 1 + min(values[position], k)
                rounds, tokens, position = rounds + 1, tokens + step, position + step
        return round(tokens / rounds, 3)

    walks = [values for chats in replies.values() for values in chats]

    result = {"model": directory, "positions": len(every), "block_size": size,
              "tau": {k: tau(every, k) for k in range(1, size + 1)},
              "tau_per_round": {k: tau_per_round(walks, k) for k in range(1, size + 1)},
              "tau_at_3_by_skill": {skill: tau(values, 3) for skill, values in accepted.items()},
              "tau_per_round_at_3_by_skill": {skill: tau_per_round(chats, 3)
                                              for skill, chats in replies.items()}}  # fmt: skip
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
