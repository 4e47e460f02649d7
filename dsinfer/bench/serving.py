"""``dsinfer bench serve``: load-test any OpenAI-compatible server with streaming requests.

Requests arrive with Gamma inter-arrival times (shape = burstiness, mean = 1 / request rate; burstiness 1 is
a Poisson process), as vLLM's ``bench serve`` does, optionally capped at ``--max-concurrency`` in flight.
Each request streams with ``stream_options.include_usage`` and records, with one clock (perf_counter):

* TTFT: first chunk that carries generated text (content, reasoning or tool-call text) minus send time;
* ITL: gaps between consecutive text-carrying chunks, pooled over all successful requests (vLLM's ITL), and the
  same gaps split in two (:mod:`dsinfer.bench.serving_itl`): *decode-only* gaps, during which no request of the
  run was prefilling (from its send time until its first text chunk; a request that got no text, until its
  end), and *with-prefill* gaps, which other requests' prompts may have lengthened;
* E2EL: send time to the last chunk of the stream (the usage chunk where the server sends one);
* TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token;
* output tokens from ``usage.completion_tokens`` (the count of text chunks if the server sends no usage).

The default client (``--client light``, :mod:`dsinfer.bench.serving_client`) streams with httpx and parses
the server-sent events itself, so that its CPU per chunk stays far below a decode step's share per stream;
``--client openai`` uses the openai SDK instead. Every chunk of one network read carries that read's time.

Outcomes: *successful* (text arrived and a ``finish_reason`` ended the stream), *errored* (an exception,
an HTTP error, an error event in the stream, or a stream without any generated text), *incomplete* (cut off
by ``--request-timeout``, or a stream that ended without a ``finish_reason``). Latency statistics use
successful requests only. The exit code is 0 when at least one request succeeded and 1 when none did (the
JSON is written either way), 2 for bad arguments or dataset files.

The JSON carries vLLM ``bench serve`` names (``completed``, ``mean_ttft_ms``, ...), the GPUStack benchmark
fields (guidellm's definitions: ``request_latency_mean`` in seconds; ``time_per_output_token_mean`` is E2EL /
output tokens, first token included; ``inter_token_latency_mean`` is the per-request decode time per token,
equal to vLLM's mean TPOT), and one record per request. Beyond vLLM's: ``mean / median / std / p50 / p90 / p95 /
p99_itl_decode_only_ms`` and ``..._itl_with_prefill_ms``, ``itl_decode_only_count`` and ``itl_with_prefill_count``
(gaps of each kind), and, with ``--offline-step-ms`` (the offline engine's decode step at the same batch),
``itl_decode_only_over_offline_step`` (mean decode-only ITL / step) and ``tpot_over_offline_step`` (mean TPOT /
step); without it they are null. Means, because a client that reads two steps' chunks at once halves the median
gap but leaves the mean as it was.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tqdm import tqdm

from dsinfer.arg_types import positive_int
from dsinfer.bench.datasets import (
    BenchRequest,
    DatasetError,
    ServerTokenCounter,
    load_jsonl,
    random_requests,
    repeat_to,
)
from dsinfer.bench.serving_client import CLIENTS, RequestRecord, make_client
from dsinfer.bench.serving_itl import split_itl
from dsinfer.bench.spec_metrics import acceptance, scrape_spec_counters

PERCENTILES = (50, 90, 95, 99)
LATENCY_METRICS = (
    ("ttft", "TTFT"),
    ("tpot", "TPOT (excl. 1st token)"),
    ("itl", "ITL"),
    ("itl_decode_only", "  ITL decode-only"),
    ("itl_with_prefill", "  ITL with prefill"),
    ("e2el", "E2EL"),
)
GPUSTACK_FIELDS = (
    "requests_per_second_mean",
    "request_latency_mean",
    "time_per_output_token_mean",
    "inter_token_latency_mean",
    "time_to_first_token_mean",
    "tokens_per_second_mean",
    "output_tokens_per_second_mean",
    "input_tokens_per_second_mean",
    "request_concurrency_mean",
    "request_concurrency_max",
    "request_total",
    "request_successful",
    "request_errored",
    "request_incomplete",
)


# ---- arguments ---------------------------------------------------------------------------------
def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _finite_positive_float(text: str) -> float:
    value = _positive_float(text)
    if math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsinfer bench serve",
        description="Streaming load test of an OpenAI-compatible server: TTFT, TPOT, ITL, E2EL, throughput.",
    )
    parser.add_argument(
        "--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000 (a /v1 suffix is fine)"
    )
    parser.add_argument("--model", required=True, help="model name to send in each request")
    parser.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        default="chat",
        help="/v1/chat/completions (default) or /v1/completions",
    )
    parser.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY, else none)")
    parser.add_argument("--dataset", choices=["random", "jsonl"], default="random")
    parser.add_argument(
        "--dataset-path",
        type=Path,
        default=None,
        help="jsonl: one object per line with 'prompt' or 'messages', optional 'output_len'",
    )
    parser.add_argument("--input-len", type=positive_int, default=1024, help="random: prompt tokens (default 1024)")
    parser.add_argument(
        "--output-len",
        type=positive_int,
        default=128,
        help="tokens to generate per request (jsonl: when a line has no output_len; default 128)",
    )
    parser.add_argument(
        "--num-prompts",
        type=positive_int,
        default=None,
        help="requests to send (default: 1000 for random, the file's lines for jsonl, cycled)",
    )
    parser.add_argument("--max-concurrency", type=positive_int, default=None, help="cap on requests in flight")
    parser.add_argument(
        "--request-rate",
        type=_positive_float,
        default=math.inf,
        help="mean requests per second (default inf: all at once)",
    )
    parser.add_argument(
        "--burstiness",
        type=_finite_positive_float,
        default=1.0,
        help="Gamma shape of inter-arrival times: 1 = Poisson, <1 burstier, >1 steadier",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the random prompts and the arrival times")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (for servers that reject unknown fields)",
    )
    parser.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    parser.add_argument(
        "--request-timeout",
        type=_finite_positive_float,
        default=None,
        help="seconds a request may take in all; slower ones count as incomplete",
    )
    parser.add_argument(
        "--client",
        choices=CLIENTS,
        default="light",
        help="light (default): httpx and a server-sent-events parser of its own; openai: the openai SDK, about 10x "
        "the CPU per chunk (one core of it falls behind at several thousand chunks a second)",
    )
    parser.add_argument(
        "--offline-step-ms",
        type=_finite_positive_float,
        default=None,
        help="the offline engine's decode step at the same batch (ms): adds ITL decode-only / step and TPOT / step",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.base_url.startswith(("http://", "https://")):
        parser.error(f"--base-url must start with http:// or https://, got {args.base_url!r}")
    if args.dataset == "jsonl" and args.dataset_path is None:
        parser.error("--dataset jsonl needs --dataset-path FILE")
    if args.dataset == "random" and args.dataset_path is not None:
        parser.error("--dataset-path is only for --dataset jsonl")
    if not 0.0 <= args.temperature <= 2.0:
        parser.error(f"--temperature must be in [0, 2], got {args.temperature}")
    if args.extra_body is not None:
        try:
            args.extra_body = json.loads(args.extra_body)
        except json.JSONDecodeError as exc:
            parser.error(f"--extra-body is not valid JSON: {exc.msg}")
        if not isinstance(args.extra_body, dict):
            parser.error("--extra-body must be a JSON object")
    if args.client == "openai":
        try:
            import openai  # noqa: F401
        except ImportError as exc:
            parser.error(f"--client openai needs the openai package ({exc})")
    if args.api_key is None:
        args.api_key = os.environ.get("OPENAI_API_KEY")
    args.server_url, args.api_url = split_base_url(args.base_url)
    if args.dataset == "jsonl":
        try:
            requests = load_jsonl(args.dataset_path, args.endpoint, args.output_len)
        except DatasetError as exc:
            parser.error(str(exc))
        args.jsonl_requests = repeat_to(requests, args.num_prompts or len(requests))
        args.num_prompts = len(args.jsonl_requests)
    elif args.num_prompts is None:
        args.num_prompts = 1000
    return args


def split_base_url(url: str) -> tuple[str, str]:
    """(server root for /tokenize, API base ending in /v1) from either spelling of the URL."""
    url = url.rstrip("/")
    return (url[: -len("/v1")], url) if url.endswith("/v1") else (url, f"{url}/v1")


# ---- arrivals ----------------------------------------------------------------------------------
def arrival_offsets(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: the first at 0, then Gamma-distributed gaps.

    Shape ``burstiness`` and scale ``1 / (request_rate * burstiness)`` keep the mean gap at 1 / rate while the
    coefficient of variation is 1 / sqrt(burstiness) (vLLM's method). An infinite rate sends all at once.
    """
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(f"arrivals-{seed}")
    scale = 1.0 / (request_rate * burstiness)
    offsets, now = [], 0.0
    for index in range(num_requests):
        if index:
            now += rng.gammavariate(burstiness, scale)
        offsets.append(now)
    return offsets


# ---- the run -----------------------------------------------------------------------------------
async def prepare_requests(args: argparse.Namespace, headers: dict[str, str]) -> tuple[list[BenchRequest], str]:
    if args.dataset == "jsonl":
        return args.jsonl_requests, f"{args.dataset_path}: {args.num_prompts} requests"
    async with httpx.AsyncClient(headers=headers, timeout=30.0) as http:
        counter = ServerTokenCounter(http, args.server_url, args.model, args.endpoint)
        return await random_requests(args.num_prompts, args.input_len, args.output_len, args.seed, counter)


async def run_benchmark(args: argparse.Namespace) -> tuple[list[RequestRecord], float, str]:
    """Send every request on its Gamma schedule under the concurrency cap; return records and the duration.

    The server's speculative-decoding counters are read before and after (``args.spec_counters``)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    requests, dataset_note = await prepare_requests(args, headers)
    counters_before = await scrape_spec_counters(args.server_url, headers)
    offsets = arrival_offsets(len(requests), args.request_rate, args.burstiness, args.seed)
    in_flight = args.max_concurrency or len(requests)
    client = make_client(args, in_flight)
    gate = asyncio.Semaphore(in_flight)
    progress = tqdm(total=len(requests), desc="requests", unit="req", disable=args.disable_tqdm)
    bench_start = time.perf_counter()

    async def scheduled(index: int) -> RequestRecord:
        await asyncio.sleep(max(0.0, bench_start + offsets[index] - time.perf_counter()))
        async with gate:
            record = RequestRecord(index=index, scheduled_s=offsets[index])
            await client.send(args, requests[index], record, bench_start)
        progress.update(1)
        return record

    try:
        records = await asyncio.gather(*(scheduled(i) for i in range(len(requests))))
    finally:
        progress.close()
        await client.close()
    duration = time.perf_counter() - bench_start
    args.spec_counters = (counters_before, await scrape_spec_counters(args.server_url, headers))
    return list(records), duration, dataset_note


# ---- metrics -----------------------------------------------------------------------------------
def _stats_ms(name: str, values_s: list[float]) -> dict[str, float | None]:
    """mean / median / std / percentiles in milliseconds (linear interpolation, as numpy and vLLM do)."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + [f"p{p}_{name}_ms" for p in PERCENTILES]
    if not values_s:
        return dict.fromkeys(keys)
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    numbers = [ms.mean(), np.median(ms), ms.std(), *np.percentile(ms, PERCENTILES)]
    return {key: float(value) for key, value in zip(keys, numbers, strict=True)}


def concurrency(records: list[RequestRecord], duration: float) -> tuple[float, int]:
    """Time-weighted mean and peak number of requests in flight (send to last byte)."""
    if not records or duration <= 0:
        return 0.0, 0
    busy = sum(r.end_s - r.start_s for r in records)
    events = sorted([(r.start_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    peak = level = 0
    for _, step in events:  # at equal times the -1 sorts first: a request that ends frees its slot
        level += step
        peak = max(peak, level)
    return busy / duration, peak


def _ratio(value_ms: float | None, step_ms: float | None) -> float | None:
    return None if value_ms is None or step_ms is None else value_ms / step_ms


def summarize(records: list[RequestRecord], duration: float, args: argparse.Namespace, dataset_note: str) -> dict:
    """The results JSON: run settings, vLLM ``bench serve`` fields, GPUStack fields, per-request records."""
    ok = [r for r in records if r.status == "successful"]
    errored = sum(r.status == "errored" for r in records)
    incomplete = sum(r.status == "incomplete" for r in records)
    total_input = sum(r.prompt_tokens or 0 for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    concurrency_mean, concurrency_max = concurrency(records, duration)
    result: dict[str, Any] = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "backend": "openai-chat" if args.endpoint == "chat" else "openai",
        "base_url": args.api_url, "model_id": args.model, "endpoint": args.endpoint,
        "dataset": args.dataset, "dataset_note": dataset_note, "num_prompts": len(records),
        "input_len": args.input_len if args.dataset == "random" else None, "output_len": args.output_len,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "seed": args.seed,
        "ignore_eos": args.ignore_eos, "temperature": args.temperature, "client": args.client,
        # vLLM bench serve
        "duration": duration, "completed": len(ok), "failed": errored + incomplete,
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration, "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "max_concurrent_requests": concurrency_max,
    }  # fmt: skip
    result |= _stats_ms("ttft", [r.ttft_s for r in ok])
    result |= _stats_ms("tpot", tpots)
    result |= _stats_ms("itl", [gap for r in ok for gap in r.itl_s])
    result |= _stats_ms("e2el", [r.e2el_s for r in ok])
    decode_only, with_prefill = split_itl(records)  # see dsinfer.bench.serving_itl
    result |= _stats_ms("itl_decode_only", decode_only) | _stats_ms("itl_with_prefill", with_prefill)
    result |= {"itl_decode_only_count": len(decode_only), "itl_with_prefill_count": len(with_prefill)}
    step = args.offline_step_ms
    result |= {
        "offline_step_ms": step,
        "itl_decode_only_over_offline_step": _ratio(result["mean_itl_decode_only_ms"], step),
        "tpot_over_offline_step": _ratio(result["mean_tpot_ms"], step),
    }
    result |= {
        "input_lens": [r.prompt_tokens or 0 for r in records],
        "output_lens": [r.output_tokens if r.status == "successful" else 0 for r in records],
        "ttfts": [r.ttft_s or 0.0 for r in records],
        "itls": [r.itl_s for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
    }
    per_token = [1000.0 * r.e2el_s / r.output_tokens for r in ok if r.output_tokens > 0]
    result |= {  # GPUStack (guidellm definitions, see the module docstring)
        "requests_per_second_mean": result["request_throughput"],
        "request_latency_mean": float(np.mean([r.e2el_s for r in ok])) if ok else None,
        "time_per_output_token_mean": float(np.mean(per_token)) if per_token else None,
        "inter_token_latency_mean": result["mean_tpot_ms"],
        "time_to_first_token_mean": result["mean_ttft_ms"],
        "tokens_per_second_mean": result["total_token_throughput"],
        "output_tokens_per_second_mean": result["output_throughput"],
        "input_tokens_per_second_mean": total_input / duration,
        "request_concurrency_mean": concurrency_mean,
        "request_concurrency_max": concurrency_max,
        "request_total": len(records),
        "request_successful": len(ok),
        "request_errored": errored,
        "request_incomplete": incomplete,
    }
    result |= acceptance(*getattr(args, "spec_counters", (None, None)))
    result["requests"] = [asdict(r) | {"tpot_s": r.tpot_s} for r in records]
    return result


def format_table(result: dict) -> str:
    """vLLM-style summary followed by one latency table (ms)."""
    rate = result["request_rate"]
    lines = [
        "{s:=^62}".format(s=" Serving Benchmark Result "),
        f"{'Endpoint / model:':<40}{result['endpoint']} / {result['model_id']}",
        f"{'Request rate (req/s) / burstiness:':<40}{rate} / {result['burstiness']}",
        f"{'Maximum request concurrency:':<40}{result['max_concurrency'] or 'unlimited'}",
        f"{'Successful / errored / incomplete:':<40}{result['request_successful']} / "
        f"{result['request_errored']} / {result['request_incomplete']}",
        f"{'Benchmark duration (s):':<40}{result['duration']:.2f}",
        f"{'Total input tokens:':<40}{result['total_input_tokens']}",
        f"{'Total generated tokens:':<40}{result['total_output_tokens']}",
        f"{'Request throughput (req/s):':<40}{result['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<40}{result['output_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<40}{result['total_token_throughput']:.2f}",
        f"{'Concurrency mean / peak:':<40}{result['request_concurrency_mean']:.2f} / "
        f"{result['request_concurrency_max']}",
        "{s:-^62}".format(s=" Latency (ms) "),
        f"{'':<24}{'mean':>9}{'median':>10}{'p95':>9}{'p99':>10}",
    ]
    for name, label in LATENCY_METRICS:
        cells = [result[f"{k}_{name}_ms"] for k in ("mean", "median", "p95", "p99")]
        lines.append(
            f"{label:<24}"
            + "".join(f"{'-' if v is None else f'{v:.2f}':>{w}}" for v, w in zip(cells, (9, 10, 9, 10), strict=True))
        )
    lines.append(
        f"{'ITL gaps decode-only / with prefill:':<40}{result['itl_decode_only_count']} / "
        f"{result['itl_with_prefill_count']}"
    )
    if result["offline_step_ms"] is not None:
        lines.append(f"{'Offline decode step (ms):':<40}{result['offline_step_ms']:.2f}")
        for key, label in (("itl_decode_only_over_offline_step", "Mean ITL decode-only / offline step:"),
                           ("tpot_over_offline_step", "Mean TPOT / offline step:")):  # fmt: skip
            value = result[key]
            lines.append(f"{label:<40}{'-' if value is None else f'{value:.3f}x'}")
    if result.get("spec_decode_acceptance_length") is not None:
        lines.append(f"{'Spec decode acceptance length:':<40}{result['spec_decode_acceptance_length']:.2f}")
        rate = result["spec_decode_acceptance_rate"]
        lines.append(f"{'Spec decode acceptance rate:':<40}{'-' if rate is None else f'{100 * rate:.1f}%'}")
    lines.append("=" * 62)
    return "\n".join(lines)


def _notes(result: dict, records: list[RequestRecord]) -> list[str]:
    notes = [f"dataset: {result['dataset_note']}"]
    short = [r for r in records if r.status == "successful" and r.output_tokens != r.expected_output_len]
    if short:
        notes.append(
            f"{len(short)} successful requests generated a different number of tokens than asked "
            "(does the server honour ignore_eos?)"
        )
    if any(r.output_tokens_source == "chunks" for r in records):
        notes.append("some streams carried no usage: their output tokens are counted as text chunks")
    errors = sorted({r.error for r in records if r.error})
    if errors:
        notes.append(f"{len(errors)} distinct failure messages, e.g.: {errors[0]}")
    return notes


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse printed the message; hand its exit code back
        return int(exc.code or 0)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    records, duration, dataset_note = asyncio.run(run_benchmark(args))
    result = summarize(records, duration, args, dataset_note)
    print(format_table(result))
    for note in _notes(result, records):
        print(f"note: {note}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"results written to {args.out}")
    return 0 if result["completed"] > 0 else 1
