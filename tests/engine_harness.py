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
