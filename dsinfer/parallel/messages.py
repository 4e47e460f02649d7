"""What the API process and the rank processes send each other: plain picklable data, never live objects.

A request travels as its specification (token ids, :class:`~dsinfer.sampling_params.SamplingParams` with its
seed and grammar specification, image inputs); the rank builds the generators and grammar matchers itself.
A rank answers each step with what changed: per completion the new token ids (and logprobs), the new text
(or the whole text when a stop string cut it), the finish reason and the request's timings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsinfer.config import EngineConfig
from dsinfer.engine.outputs import RequestMetrics
from dsinfer.parallel.config import ParallelConfig
from dsinfer.sampling_params import SamplingParams


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs to start: the model, the engine options, its place in the layout."""

    model_dir: str
    engine: EngineConfig
    parallel: ParallelConfig
    rank: int
    master_port: int
    log_level: str = "WARNING"


# ---- API process -> rank ------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    images: tuple = ()


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Wake:
    """Sent to every rank with each new request: idle ranks leave their wait and step together."""


@dataclass(frozen=True)
class Shutdown:
    """Every rank stops after the step in progress (they agree on it in their per-step exchange)."""


# ---- rank -> API process ------------------------------------------------------------------------


@dataclass(frozen=True)
class RankReady:
    rank: int
    pid: int
    max_model_len: int
    num_blocks: int
    block_tokens: int
    placement: str


@dataclass
class CompletionDelta:
    index: int
    new_token_ids: list[int]
    text: str  # appended to the text so far, or the whole text when ``text_replaces``
    text_replaces: bool
    finish_reason: str | None
    new_logprobs: list[float] | None = None
    new_top_logprobs: list | None = None


@dataclass
class RequestDelta:
    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    metrics: RequestMetrics


@dataclass
class RankLoad:
    """The counters the API process shows as metrics and balances by."""

    waiting: int = 0
    running: int = 0
    blocks_used: int = 0
    num_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    preemptions: int = 0


@dataclass
class StepReport:
    rank: int
    deltas: list[RequestDelta] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)  # (request id, message)
    load: RankLoad = field(default_factory=RankLoad)


@dataclass(frozen=True)
class RankFailed:
    rank: int
    message: str
