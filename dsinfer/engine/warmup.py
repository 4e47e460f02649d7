"""Start-up kernel warm-up: every prefill shape a served prompt can reach is compiled before the first request.

The Triton kernels specialise on what a step's shapes make of them (block widths chosen from the tokens of a
chunk, power-of-two buckets of the entries a chunk attends to and selects from, whether a count divides by 16,
V4.1's bounded replay at a prompt's end), and each new specialisation compiles on first use: a 131,072-token
prompt after a short start-up request met about 6 s of compiles in its first chunks, and a 16-token request after
a warm-up of long chunks only, 8 s. The warm-up runs one prefill chunk at each shape where a bucket can change:
prompts of every power of two up to the step budget and one token short of each, then full chunks at the budget
times every power of two below ``max_model_len`` and the longest prompt's odd last chunk. A chunk
starts past position 0 the way a prefix-cache hit does (``num_computed`` set, the earlier blocks allocated but
left as they are): the kernels' shapes are a real chunk's, only the numbers they read are stale, and nothing
they produce is kept. Afterwards the blocks are free, the prefix cache is emptied (the warm-up prompts' blocks
hold no real entries) and the engine's counters are as a fresh engine's.

The warm-up costs one chunk per position (a few tenths of a second each on the 4-layer slice) plus the compiles,
which Triton's on-disk cache makes cheap on every later start-up.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING

from dsinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dsinfer.engine.engine import LLMEngine

ODD_TAIL = 13  # an odd final chunk: counts that do not divide by 16 compile their own specialisation


def warm_up_positions(budget: int, max_model_len: int) -> list[tuple[int, int]]:
    """``(start, tokens)`` of each warm-up chunk. At position 0: a prompt of every power of two up to the budget and
    one token short of each (the block widths a launcher picks from a chunk's tokens, and counts that do or do not
    divide by 16); then a full chunk (or what is left before ``max_model_len``) at ``budget * 2**k`` for every k
    that stays inside it, and the longest prompt's odd last chunk."""
    longest = max_model_len - 1  # a prompt leaves room for its first output token
    sizes, size = {1, min(budget, longest)}, 2
    while size <= min(budget, longest):
        sizes.update((size, size - 1))
        size *= 2
    chunks = [(0, n) for n in sorted(sizes, reverse=True)]
    start = budget
    while start < longest:
        chunks.append((start, min(budget, longest - start)))
        start *= 2
    if longest > budget:
        chunks.append((longest - ODD_TAIL, ODD_TAIL))  # the longest prompt's last chunk
    return list(dict.fromkeys(chunks))


def warm_up_kernels(engine: LLMEngine) -> dict[str, float]:
    """Run every warm-up chunk through ``engine`` and leave it as if none had run; returns what it did."""
    started = time.perf_counter()
    budget, vocab = engine.config.step_token_budget, engine.checker.vocab_size  # what a prompt may hold
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ran = 0
    for start, tokens in warm_up_positions(budget, engine.max_model_len):
        if engine.blocks.blocks_needed_for(start + tokens) > engine.blocks.num_free:
            continue  # the cache cannot hold a prompt this long: no request will reach this shape either
        prompt = [rng.randrange(3, vocab) for _ in range(start + tokens)]
        request_id = engine.add_request(prompt, params, request_id=f"kernel-warm-up-{ran}")
        for seq in engine.requests[request_id]:
            seq.num_computed = start  # as after a prefix-cache hit of `start` tokens (stale entries)
        while engine.has_unfinished_requests():
            engine.step()
        engine.finish(request_id)
        ran += 1
    engine.settle()
    engine.blocks.reset_prefix_cache()
    engine.scheduler.num_preemptions = 0
    return {"chunks": ran, "seconds": time.perf_counter() - started}
