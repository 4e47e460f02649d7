"""``dsinfer bench serve`` against the real tiny server on 127.0.0.1, plus its arrival and dataset helpers."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from server_harness import free_port, running_server

from dsinfer.bench import serving
from dsinfer.bench.datasets import DatasetError, load_jsonl

OUTPUT_LEN = 8
PROMPTS = 4
VLLM_FIELDS = (
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "errors",
    *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p50", "p90", "p95", "p99")),
)  # fmt: skip


@pytest.fixture(scope="module")
def base_url(tiny_checkpoint):
    with running_server(tiny_checkpoint) as (base, _engine):
        yield base


def bench(tmp_path, *options: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    code = serving.main([*options, "--model", "tiny", "--disable-tqdm", "--out", str(out)])
    return code, json.loads(out.read_text())


@pytest.mark.parametrize(("endpoint", "client"), [("chat", "light"), ("completions", "light"), ("chat", "openai")])
def test_random_run_records_consistent_metrics(base_url, tmp_path, capsys, endpoint, client):
    options = ["--base-url", base_url, "--endpoint", endpoint, "--input-len", "24", "--output-len", str(OUTPUT_LEN),
               "--num-prompts", str(PROMPTS), "--max-concurrency", "2", "--request-rate", "40",
               "--seed", "1", "--client", client, "--offline-step-ms", "2.5"]  # fmt: skip
    code, result = bench(tmp_path, *options)
    assert code == 0
    out = capsys.readouterr().out
    assert "TTFT" in out and "ITL decode-only" in out and "Mean TPOT / offline step:" in out
    assert result["client"] == client
    records = result["requests"]
    assert [r["status"] for r in records] == ["successful"] * PROMPTS
    for record in records:
        assert 0 < record["ttft_s"] < record["e2el_s"]
        assert record["output_tokens_source"] == "usage"
        assert record["output_tokens"] == record["expected_output_len"] == OUTPUT_LEN  # ignore_eos honoured
        assert record["prompt_tokens"] == 24  # the server's /tokenize confirmed the random prompt's length
        assert sum(record["itl_s"]) <= record["e2el_s"] - record["ttft_s"] + 1e-9
        assert record["tpot_s"] == pytest.approx((record["e2el_s"] - record["ttft_s"]) / (OUTPUT_LEN - 1))
    # Sends follow the seeded Gamma schedule, never early, and the cap holds.
    assert [r["scheduled_s"] for r in records] == serving.arrival_offsets(PROMPTS, 40.0, 1.0, 1)
    assert all(r["start_s"] >= r["scheduled_s"] - 1e-6 for r in records)
    assert 1 <= result["request_concurrency_max"] == result["max_concurrent_requests"] <= 2

    for name in (*VLLM_FIELDS, *serving.GPUSTACK_FIELDS):
        assert name in result, name
    duration = result["duration"]
    assert result["completed"] == result["request_successful"] == PROMPTS
    assert result["request_total"] == PROMPTS and result["request_errored"] == result["request_incomplete"] == 0
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN
    assert result["total_input_tokens"] == sum(r["prompt_tokens"] for r in records) == PROMPTS * 24
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / duration)
    assert result["request_throughput"] == pytest.approx(PROMPTS / duration) == result["requests_per_second_mean"]
    assert result["total_token_throughput"] == pytest.approx((PROMPTS * 24 + PROMPTS * OUTPUT_LEN) / duration)
    assert result["tokens_per_second_mean"] == result["total_token_throughput"]
    assert result["output_tokens_per_second_mean"] == result["output_throughput"]
    assert result["input_tokens_per_second_mean"] == pytest.approx(PROMPTS * 24 / duration)
    assert result["mean_ttft_ms"] == pytest.approx(1000 * statistics.mean(r["ttft_s"] for r in records))
    assert result["time_to_first_token_mean"] == result["mean_ttft_ms"]
    assert result["mean_itl_ms"] == pytest.approx(1000 * statistics.mean(g for r in records for g in r["itl_s"]))
    assert result["inter_token_latency_mean"] == result["mean_tpot_ms"]
    assert result["request_latency_mean"] * 1000 == pytest.approx(result["mean_e2el_ms"])
    assert result["time_per_output_token_mean"] == pytest.approx(result["mean_e2el_ms"] / OUTPUT_LEN)
    assert result["request_concurrency_mean"] == pytest.approx(
        sum(r["end_s"] - r["start_s"] for r in records) / duration
    )
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert result[f"median_{metric}_ms"] == result[f"p50_{metric}_ms"]
        assert result[f"p50_{metric}_ms"] <= result[f"p95_{metric}_ms"] <= result[f"p99_{metric}_ms"]
    assert result["output_lens"] == [OUTPUT_LEN] * PROMPTS and result["errors"] == [""] * PROMPTS
    # Every pooled ITL gap is either decode-only or with-prefill; the ratios use the means.
    gaps = sorted(g for r in records for g in r["itl_s"])
    assert result["itl_decode_only_count"] + result["itl_with_prefill_count"] == len(gaps)
    for kind in ("decode_only", "with_prefill"):
        if result[f"itl_{kind}_count"]:
            assert gaps[0] <= result[f"median_itl_{kind}_ms"] / 1000 <= gaps[-1]
        else:
            assert result[f"mean_itl_{kind}_ms"] is None
    assert result["offline_step_ms"] == 2.5
    assert result["tpot_over_offline_step"] == pytest.approx(result["mean_tpot_ms"] / 2.5)
    if result["itl_decode_only_count"]:
        assert result["itl_decode_only_over_offline_step"] == pytest.approx(result["mean_itl_decode_only_ms"] / 2.5)


def test_jsonl_prompts_and_messages_with_their_own_output_lengths(base_url, tmp_path):
    data = tmp_path / "requests.jsonl"
    lines = [{"prompt": "Tell me about the sea.", "output_len": 3},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}]  # fmt: skip
    data.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    code, result = bench(tmp_path, "--base-url", f"{base_url}/v1", "--dataset", "jsonl", "--dataset-path", str(data),
                         "--output-len", "5", "--num-prompts", "3")  # fmt: skip
    assert code == 0
    assert [r["output_tokens"] for r in result["requests"]] == [3, 5, 3]  # the file cycles to --num-prompts
    assert result["total_output_tokens"] == 11


def test_reasoning_stream_counts_as_generated_text(base_url, tmp_path):
    """Thinking mode streams reasoning_content (the tiny model never closes </think>): still tokens, timed."""
    data = tmp_path / "think.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "Think."}]}) + "\n")
    thinking = json.dumps({"chat_template_kwargs": {"thinking": True}})
    code, result = bench(tmp_path, "--base-url", base_url, "--dataset", "jsonl", "--dataset-path", str(data),
                         "--output-len", "6", "--extra-body", thinking)  # fmt: skip
    assert code == 0
    record = result["requests"][0]
    assert record["status"] == "successful" and record["output_tokens"] == 6
    assert record["generated_text"] and 0 < record["ttft_s"] < record["e2el_s"]


@pytest.mark.parametrize(("client", "error"), [("light", "ConnectError"), ("openai", "APIConnectionError")])
def test_unreachable_server_counts_every_request_as_errored(tmp_path, capsys, client, error):
    closed = f"http://127.0.0.1:{free_port()}"  # bound and released: nothing listens there
    code, result = bench(tmp_path, "--base-url", closed, "--input-len", "8", "--output-len", "4", "--num-prompts", "4",
                         "--client", client)  # fmt: skip
    assert code == 1  # nothing succeeded; the JSON is still written
    assert result["request_errored"] == result["failed"] == result["request_total"] == 4
    assert result["completed"] == result["request_successful"] == 0
    assert result["mean_ttft_ms"] is None and result["time_to_first_token_mean"] is None
    assert all(message.startswith(error) for message in result["errors"])
    assert result["offline_step_ms"] is None and result["itl_decode_only_over_offline_step"] is None
    assert "no usable /tokenize" in result["dataset_note"]
    assert "errored / incomplete:" in capsys.readouterr().out


@pytest.mark.parametrize("client", ["light", "openai"])
def test_request_timeout_counts_incomplete(base_url, tmp_path, client):
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"prompt": "slow", "output_len": 64}) + "\n")
    code, result = bench(tmp_path, "--base-url", base_url, "--dataset", "jsonl", "--dataset-path", str(data),
                         "--endpoint", "completions", "--request-timeout", "0.05", "--client", client)  # fmt: skip
    assert code == 1
    assert result["request_incomplete"] == 1 and result["request_errored"] == 0
    assert result["requests"][0]["error"].startswith("timed out")


@pytest.mark.parametrize("client", ["light", "openai"])
def test_http_error_carries_the_servers_message(base_url, tmp_path, client):
    """A request the server refuses (here: a prompt longer than the context) is errored, with the server's words."""
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "the " * 2000, "output_len": 4}) + "\n")
    code, result = bench(tmp_path, "--base-url", base_url, "--dataset", "jsonl", "--dataset-path", str(data),
                         "--endpoint", "completions", "--client", client)  # fmt: skip
    assert code == 1
    assert result["request_errored"] == 1
    error = result["requests"][0]["error"]
    assert error.startswith("HTTP 400: ") and "{" not in error, error


def test_arrivals_are_seeded_gamma_with_mean_one_over_rate():
    assert serving.arrival_offsets(5, math.inf, 1.0, 0) == [0.0] * 5
    first = serving.arrival_offsets(20_000, 4.0, 1.0, seed=7)
    assert first == serving.arrival_offsets(20_000, 4.0, 1.0, seed=7)
    assert first != serving.arrival_offsets(20_000, 4.0, 1.0, seed=8)
    assert first[0] == 0.0 and all(b >= a for a, b in zip(first, first[1:], strict=False))
    for burstiness in (0.5, 1.0, 4.0):
        offsets = serving.arrival_offsets(20_000, 4.0, burstiness, seed=3)
        gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
        mean = statistics.fmean(gaps)
        assert mean == pytest.approx(0.25, rel=0.03)
        # Gamma(shape k): coefficient of variation 1 / sqrt(k); Poisson (k = 1) has CV 1.
        assert statistics.pstdev(gaps) / mean == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_malformed_jsonl_names_the_line(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "fine"}\n\n{"prompt": "broken"\n')
    code = serving.main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--dataset", "jsonl",
                         "--dataset-path", str(data)])  # fmt: skip
    assert code == 2
    assert f"{data}:3: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "endpoint", "message"),
    [
        ('["prompt"]', "chat", "expected a JSON object"),
        ('{"prompt": "a", "messages": []}', "chat", "exactly one of 'prompt'"),
        ('{"prompt": 5}', "chat", "'prompt' must be a string"),
        ('{"messages": [{"content": "no role"}]}', "chat", "'messages' must be a non-empty list"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "completions", "'messages' needs --endpoint chat"),
        ('{"prompt": "a", "output_len": 0}', "chat", "'output_len' must be a positive integer"),
    ],
)
def test_jsonl_line_errors(tmp_path, line, endpoint, message):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(DatasetError, match=f"d.jsonl:2: .*{message}"):
        load_jsonl(data, endpoint, 8)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "m"], "--base-url"),
        (["--base-url", "localhost:8000", "--model", "m"], "must start with http://"),
        (["--base-url", "http://h", "--model", "m", "--burstiness", "0"], "--burstiness: must be a positive"),
        (["--base-url", "http://h", "--model", "m", "--request-rate", "-2"], "--request-rate: must be a positive"),
        (["--base-url", "http://h", "--model", "m", "--num-prompts", "x"], "--num-prompts: must be a positive"),
        (["--base-url", "http://h", "--model", "m", "--dataset", "jsonl"], "needs --dataset-path"),
        (["--base-url", "http://h", "--model", "m", "--extra-body", "[1]"], "--extra-body must be a JSON object"),
        (["--base-url", "http://h", "--model", "m", "--client", "aiohttp"], "--client: invalid choice"),
        (["--base-url", "http://h", "--model", "m", "--offline-step-ms", "0"], "--offline-step-ms: must be a positive"),
    ],
)
def test_argument_errors(capsys, argv, message):
    assert serving.main(argv) == 2
    assert message in capsys.readouterr().err
