"""Prometheus metrics of the server, vLLM-style names under the ``dsinfer:`` prefix.

Each server owns its registry, so several servers (tests) in one process never share counters.

The expert-offload families (``dsinfer:expert_offload_*``, :mod:`dsinfer.offload`) are registered on the first
report of an engine that offloads experts, so a server whose experts are all resident does not export them.
"""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# The families with the model name as their only label (their served series are bound once, below).
SERIES = (
    "running", "waiting", "cache_usage", "blocks_in_use", "prompt_tokens", "generation_tokens", "ttft", "itl", "e2e",
    "queue_time", "prefix_queries", "prefix_hits", "spec_drafts", "spec_draft_tokens", "spec_accepted",
)  # fmt: skip
# The expert-offload counters: (family, help) by OffloadTraffic field; the gauges follow.
OFFLOAD_COUNTERS = {
    "reads": ("expert_offload_reads", "Routed-expert reads of offloaded layers (one per expert a step chose)"),
    "gpu_reads": ("expert_offload_gpu_hits", "Of those reads, the ones served by experts resident on the GPU"),
    "fetched_experts": ("expert_offload_fetched_experts", "Experts copied host -> GPU (misses and fetches ahead)"),
    "fetched_ahead": ("expert_offload_fetched_ahead_experts", "Of those, the experts fetched ahead of their layer"),
    "copied_bytes": ("expert_offload_pcie_bytes", "Bytes of routed experts copied host -> GPU"),
}
OFFLOAD_GAUGES = {
    "resident_experts": ("expert_offload_resident_experts", "Routed experts kept on the GPU (all offloaded layers)"),
    "offloaded_experts": ("expert_offload_offloaded_experts", "Routed experts kept in host memory only"),
}
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60, 120)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"dsinfer:{name}", doc, labels, registry=reg)

        def counter(name: str, doc: str, extra: list[str] | None = None) -> Counter:
            return Counter(f"dsinfer:{name}", doc, labels + (extra or []), registry=reg)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"dsinfer:{name}", doc, labels, buckets=LATENCY_BUCKETS, registry=reg)

        self.running = gauge("num_requests_running", "Sequences in the running batch")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled")
        self.cache_usage = gauge("kv_cache_usage_perc", "Fraction of compressed-cache blocks in use (0-1)")
        self.blocks_in_use = gauge("kv_cache_blocks_in_use", "Compressed-cache blocks referenced by sequences")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.request_success = counter("request_success", "Finished requests", ["finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling")
        self.prefix_queries = counter("prefix_cache_queries", "Cache blocks looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Cache blocks found in the prefix cache")
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative draft rounds")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative draft tokens proposed")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted")
        self.spec_accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Speculative drafts accepted, by draft position", ["position"]
        )
        self.model_name = model_name
        # The served model's series, looked up once: ``labels()`` takes a lock and validates its arguments, and
        # the engine thread updates these every step, so the lookups stay off that path. Binding
        # them also exports the counters' zeros from the start.
        self.series = SimpleNamespace(**{name: getattr(self, name).labels(model_name) for name in SERIES})
        self._finished: dict[str, object] = {}
        self._accepted_at: dict[int, object] = {}
        self._offload_series: dict[str, object] | None = None

    def offload_series(self) -> dict[str, object]:
        """The served model's expert-offload series by traffic field, registered on the first call."""
        if self._offload_series is None:
            families = {field: Counter(f"dsinfer:{name}", doc, ["model_name"], registry=self.registry)
                        for field, (name, doc) in OFFLOAD_COUNTERS.items()}  # fmt: skip
            families |= {field: Gauge(f"dsinfer:{name}", doc, ["model_name"], registry=self.registry)
                         for field, (name, doc) in OFFLOAD_GAUGES.items()}  # fmt: skip
            self._offload_series = {field: family.labels(self.model_name) for field, family in families.items()}
        return self._offload_series

    def finished(self, reason: str):
        """The served model's ``request_success`` series for one finish reason."""
        if reason not in self._finished:
            self._finished[reason] = self.request_success.labels(self.model_name, reason)
        return self._finished[reason]

    def accepted_at(self, position: int):
        """The served model's accepted-drafts series for one draft position."""
        if position not in self._accepted_at:
            self._accepted_at[position] = self.spec_accepted_per_pos.labels(self.model_name, str(position))
        return self._accepted_at[position]
