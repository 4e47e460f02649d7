"""Speculative-decoding acceptance of a served run, from the server's Prometheus counters before and after.

A server that exposes vLLM's spec-decode counters (``dsinfer:`` or ``vllm:`` prefix: ``spec_decode_num_drafts``,
``spec_decode_num_draft_tokens``, ``spec_decode_num_accepted_tokens``) is scraped at ``/metrics`` around the
benchmark; the differences give the acceptance over the run: ``spec_decode_acceptance_length`` (tokens per
verify round, 1 + accepted / rounds, vLLM's "acceptance length") and ``spec_decode_acceptance_rate``.
"""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
PREFIXES = ("dsinfer:", "vllm:")


def parse_spec_counters(text: str) -> dict[str, float] | None:
    """Sum each counter over its label sets; None when the server exports none of them."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:  # a counter's value sample is NAME_total (or NAME); NAME_created is not one
            for prefix in PREFIXES:
                name = sample.name.removeprefix(prefix).removesuffix("_total")
                if sample.name.startswith(prefix) and name in COUNTERS:
                    totals[name] = totals.get(name, 0.0) + sample.value
    return totals if set(COUNTERS) <= set(totals) else None


async def scrape_spec_counters(server_url: str, headers: dict[str, str]) -> dict[str, float] | None:
    """The counters now, or None when the server has no /metrics or no spec-decode counters there."""
    try:
        async with httpx.AsyncClient(headers=headers, timeout=10.0) as http:
            response = await http.get(f"{server_url}/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return parse_spec_counters(response.text)
    except ValueError:  # not Prometheus text
        return None


def acceptance(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """The run's acceptance fields (all None when the server exposed no counters or ran no drafts)."""
    empty = {"spec_decode_acceptance_length": None, "spec_decode_acceptance_rate": None,
             "spec_decode_num_drafts": None, "spec_decode_num_draft_tokens": None,
             "spec_decode_num_accepted_tokens": None}  # fmt: skip
    if before is None or after is None:
        return empty
    delta = {name: after[name] - before[name] for name in COUNTERS}
    rounds, drafts, accepted = (delta[name] for name in COUNTERS)
    if rounds <= 0:
        return empty
    return {
        "spec_decode_acceptance_length": 1 + accepted / rounds,
        "spec_decode_acceptance_rate": accepted / drafts if drafts else None,
        "spec_decode_num_drafts": int(rounds),
        "spec_decode_num_draft_tokens": int(drafts),
        "spec_decode_num_accepted_tokens": int(accepted),
    }
