"""What drives an engine, and what it reports back: the one contract of every engine client.

The offline :class:`~dsinfer.llm.LLM` and the server's :class:`~dsinfer.server.async_engine.AsyncEngine` drive an
engine that steps in this process (:class:`~dsinfer.engine.engine.LLMEngine`) or in processes of its own
(:class:`~dsinfer.parallel.ranked_engine.RankedEngine`) through the same calls, and read its load for metrics
and admission limits from :class:`EngineLoad` instead of reaching into a scheduler or a block manager (which an
engine in other processes does not have).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from dsinfer.engine.outputs import RequestOutput
from dsinfer.offload.traffic import OffloadTraffic
from dsinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dsinfer.speculative.executor import SpeculativeStats


@dataclass(frozen=True)
class EngineLoad:
    """An engine's counters at one moment (summed over its ranks): what metrics show and limits check."""

    waiting: int = 0  # sequences queued for their first step (or preempted, waiting to run again)
    running: int = 0  # sequences holding a slot
    blocks_used: int = 0  # KV blocks held by sequences or kept for prefix reuse
    num_blocks: int = 0  # KV blocks in all
    prefix_queries: int = 0  # blocks looked up in the prefix cache, since the start
    prefix_hits: int = 0  # blocks found there
    preemptions: int = 0  # sequences preempted to make room, since the start
    spec_stats: SpeculativeStats | None = None  # speculative decoding's totals (None: not speculating)
    expert_offload: OffloadTraffic | None = None  # expert-offload traffic (None: every expert resident)

    @property
    def cache_usage(self) -> float:
        """The share of KV blocks in use (0 with no blocks)."""
        return self.blocks_used / max(self.num_blocks, 1)


class EngineClient(Protocol):
    """The calls every engine answers. Bad input to ``add_request`` raises ``ValueError`` and changes nothing."""

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, images: list | None = None) -> str:  # fmt: skip
        """Queue a request (a prompt as text or token ids); returns its id."""
        ...

    def abort(self, request_id: str) -> None:
        """End a request now and free what it holds; unknown or finished ids are ignored."""
        ...

    def finish(self, request_id: str, reason: str = "stop") -> None:
        """End a request its consumer has completed (a stop string the protocol parser found in its text): what
        it holds is freed as by ``abort``, but its unfinished completions end with ``reason``, not ``abort``, so
        whoever counts finish reasons counts a stop. Unknown or finished ids are ignored."""
        ...

    def step(self) -> list[RequestOutput]:
        """Advance the engine; every request that changed since the last call, with all its output so far."""
        ...

    def has_unfinished_requests(self) -> bool:
        """True while any request still runs (``step`` has more to give)."""
        ...

    def unfinished_completions(self, request_id: str) -> int:
        """How many of a request's completions still run (0 for an unknown or finished request)."""
        ...

    def load(self) -> EngineLoad:
        """The engine's counters now (cheap: metrics read it after every step)."""
        ...

    def close(self) -> None:
        """Stop the engine (a step in flight finishes first); unusable afterwards."""
        ...


@runtime_checkable
class ReportingEngineClient(EngineClient, Protocol):
    """An engine in processes of its own whose reports an event loop reads as they arrive (no thread steps it)."""

    def attach(self, loop, deliver, failed) -> None:
        """Read the reports in ``loop``: ``deliver(outputs)`` per wake-up, ``failed(reason)`` once if it dies."""
        ...

    def detach(self) -> None:
        """Stop reading in the attached loop."""
        ...
