"""The measured points and how each is timed, written once for both engines.

Both engines are driven through their offline ``LLM`` the same way: random token-id prompts (ids 3 and up, no
two alike, so nothing is shared), greedy sampling, ``ignore_eos`` with ``min_tokens`` = ``max_tokens`` so every
request runs exactly as long as asked, no detokenisation, prefix caching off.

* prefill N: one N-token prompt, one output token; tokens/s = N / wall time of ``generate``, after an untimed
  ``generate`` of the same shape.
* decode B @ C (``generate`` method, the peer kit's): B prompts of C tokens; ms/step =
  (t(1 + D tokens) - t(1 token)) / D, after an untimed ``generate`` of 4 tokens of the same batch (D = 128). The
  prefill and the first token cancel; what is left is D decode steps of B sequences (with MTP: D output tokens
  per sequence, however many steps that took).
* decode B @ C (``stream`` method, for contexts where three prefills of B x C tokens would not fit a run): one
  ``generate``-like loop over the engine's own ``step()``; the wall clock is read when every sequence holds
  1 + W tokens and again when every one holds 1 + W + D; ms/step = the difference / D. One prefill, the same
  definition of a step. Every request may run on past 1 + W + D by as many tokens as the fill has steps, so the
  ones prefilled first are still decoding when the last one starts: the timed steps all decode B sequences.
  With ``vllm_slice.py --profile`` they may run on by 3 x P more (P = 32): room for a profile of P full-batch
  steps right after the timed window (the same run, no second prefill). The rest is run out untimed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

DECODE_TOKENS = 128
GENERATE_WARM_TOKENS = 4
STREAM_WARM_TOKENS = 8
PROFILE_STEPS = 32  # decode steps in a profiled window
PROFILE_RUN_ON = 3 * PROFILE_STEPS  # tokens a profiled request may make past its window's start (MTP, run-ahead)
MIN_STEP_TOKENS = 16384
DEFINITIONS = {
    "prefill": "one N-token prompt, 1 output token: N / wall time of generate(), after an untimed identical one",
    "generate": "(t(generate 1+D tokens) - t(generate 1 token)) / D for B prompts of C tokens, after an untimed "
    "generate() of 4 tokens of the same batch; D = {d}",
    "stream": "one run over the engine's step(): (time all B sequences hold 1+W+D tokens - time all hold 1+W) / D, "
    "W = {w}, D = {d}",
}


@dataclass(frozen=True)
class Point:
    """One row of the table: a prefill of ``tokens`` tokens, or decode of ``batch`` requests at ``context``."""

    kind: str  # "prefill" or "decode"
    tokens: int = 0
    batch: int = 0
    context: int = 0
    method: str = "generate"  # decode only: "generate" or "stream"
    profile_room: int = 0  # stream only: tokens each request may run on for a profile after the timed window

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill {self.tokens}"
        return f"decode {self.batch} @ {self.context}"

    @property
    def unit(self) -> str:
        return "tokens/s" if self.kind == "prefill" else "ms/step"

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "tokens": self.tokens,
            "batch": self.batch,
            "context": self.context,
            "method": self.method,
            "profile_room": self.profile_room,
        }


def point_from_dict(data: dict[str, Any]) -> Point:
    return Point(**data)


def default_points(prefills: Sequence[int], batches: Sequence[int], contexts: Sequence[int]) -> list[Point]:
    """Prefill rows first, then decode rows by context, then batch."""
    rows = [Point("prefill", tokens=n) for n in prefills]
    rows += [Point("decode", batch=b, context=c) for c in contexts for b in batches]
    return rows


def long_points(batches: Sequence[int], context: int, profiled: bool = False) -> list[Point]:
    """Decode at a long context through the stream method (one prefill of B x C tokens, not three); ``profiled``:
    with room for a profiled window after the timed one."""
    room = PROFILE_RUN_ON if profiled else 0
    return [Point("decode", batch=b, context=context, method="stream", profile_room=room) for b in batches]


def step_budget(points: Sequence[Point]) -> int:
    """Tokens per step: the longest prefill in one step, and never below 16,384."""
    return max([p.tokens for p in points if p.kind == "prefill"] + [MIN_STEP_TOKENS])


def stream_run_on(point: Point, budget: int) -> int:
    """Tokens a stream-method request may make past its timed ones: at least the steps of the fill (each step
    prefills ``budget`` tokens or finishes a prompt), so none finishes before the last one is prefilled; then the
    point's room for a profile after the timed window."""
    return -(-point.batch * point.context // budget) + point.batch + point.profile_room


def new_tokens(point: Point, decode_tokens: int, budget: int) -> int:
    """Output tokens per request of a decode point's longest run."""
    if point.method == "stream":
        return 1 + STREAM_WARM_TOKENS + decode_tokens + stream_run_on(point, budget)
    return 1 + decode_tokens


def engine_limits(points: Sequence[Point], decode_tokens: int, speculative_tokens: int) -> dict[str, int]:
    """What one engine must hold to run every point: the longest sequence (with room for the drafts of the last
    step), the most sequences at once, and the step budget."""
    budget = step_budget(points)
    longest = max(
        [p.tokens + 1 for p in points if p.kind == "prefill"]
        + [p.context + new_tokens(p, decode_tokens, budget) for p in points if p.kind == "decode"]
    )
    return {
        "max_model_len": longest + speculative_tokens + 8,
        "max_num_seqs": max([p.batch for p in points if p.kind == "decode"] + [1]),
        "max_num_batched_tokens": budget,
    }


def graph_batches(points: Sequence[Point]) -> list[int]:
    """The decode batch sizes to capture CUDA graphs for: exactly the ones measured."""
    return sorted({p.batch for p in points if p.kind == "decode"})


class PromptMaker:
    """Random token-id prompts from one seeded stream: every prompt differs, so no prefix is shared."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size, self.rng = vocab_size, random.Random(seed)

    def __call__(self, count: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(3, self.vocab_size) for _ in range(length)] for _ in range(count)]


class StepEngine(Protocol):
    """An engine driven one step at a time (for the stream method)."""

    def add(self, prompt: list[int], new_tokens: int) -> None: ...

    def step(self) -> list: ...

    def busy(self) -> bool: ...


class Engine(StepEngine, Protocol):
    def generate(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Run ``prompts`` to exactly ``new_tokens`` output tokens each; wall seconds."""
        ...


def measure_point(
    point: Point,
    engine: Engine,
    prompts: PromptMaker,
    decode_tokens: int,
    budget: int,
    after_window: Callable[[], None] | None = None,
) -> float:
    """The point's figure: prefill tokens/s, or decode ms/step (see the module docstring); ``budget``: the
    engine's tokens per step. ``after_window``: for the stream method, called once the timed window has closed,
    while every request still decodes (a profile of the steps that follow)."""
    generate = engine.generate
    if point.kind == "prefill":
        generate(prompts(1, point.tokens), 1)
        return point.tokens / generate(prompts(1, point.tokens), 1)
    if point.method == "stream":
        run_on = stream_run_on(point, budget)
        batch = prompts(point.batch, point.context)
        seconds = timed_stream(engine, batch, STREAM_WARM_TOKENS, decode_tokens, run_on, after_window)
        return 1e3 * seconds / decode_tokens
    generate(prompts(point.batch, point.context), GENERATE_WARM_TOKENS)
    total = generate(prompts(point.batch, point.context), 1 + decode_tokens)
    # The faster of two one-token runs: a one-off stall in the subtrahend (seen once in vLLM: -64 ms a step)
    # would otherwise come out as a negative or too-fast step.
    first = min(generate(prompts(point.batch, point.context), 1) for _ in range(2))
    if total <= first:
        raise RuntimeError(f"{point.label}: {1 + decode_tokens} tokens took {total:.3f} s, no longer than 1 token")
    return 1e3 * (total - first) / decode_tokens


def step_until_all_hold(engine: StepEngine, held: dict[str, int], requests: int, tokens: int) -> None:
    """Step until each of ``requests`` requests holds at least ``tokens`` output tokens; ``held`` (request id:
    tokens) is kept up to date from the step outputs, whose ``outputs[0].token_ids`` are cumulative."""
    while len(held) < requests or min(held.values()) < tokens:
        if not engine.busy():
            raise RuntimeError(f"the engine finished with {held} tokens held, short of {tokens} each")
        for output in engine.step():
            held[output.request_id] = len(output.outputs[0].token_ids)


def timed_stream(
    engine: StepEngine,
    prompts: list[list[int]],
    warm: int,
    measured: int,
    run_on: int,
    after_window: Callable[[], None] | None = None,
) -> float:
    """Drive an engine's step loop over ``prompts`` (each added to make ``1 + warm + measured + run_on`` tokens)
    and return the seconds between every sequence holding ``1 + warm`` tokens and every one holding
    ``1 + warm + measured``; then call ``after_window`` and run the rest out."""
    for ids in prompts:
        engine.add(ids, 1 + warm + measured + run_on)
    held: dict[str, int] = {}
    step_until_all_hold(engine, held, len(prompts), 1 + warm)
    start = time.perf_counter()
    step_until_all_hold(engine, held, len(prompts), 1 + warm + measured)
    end = time.perf_counter()
    if after_window is not None:
        after_window()
    while engine.busy():
        engine.step()
    return end - start
