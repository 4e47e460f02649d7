"""``dsinfer bench serve``'s light client on canned streams, and its split of ITL by prefill, on synthetic records."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from dsinfer.bench.datasets import BenchRequest
from dsinfer.bench.serving import parse_args, summarize
from dsinfer.bench.serving_client import EventReader, RequestRecord, make_client
from dsinfer.bench.serving_itl import merge, prefill_intervals, split_itl, with_prefill_mask


# ---- the server-sent-events parser ----------------------------------------------------------------
def test_event_reader_splits_events_across_reads():
    reader = EventReader()
    assert reader.feed(b'data: {"a": 1}\n\ndata: {"b"') == [(None, b'{"a": 1}')]
    assert reader.feed(b": 2}\n") == []
    assert reader.feed(b"\n") == [(None, b'{"b": 2}')]


def test_event_reader_line_endings_fields_and_comments():
    reader = EventReader()
    # CRLF split between two reads, a comment, an event name, two data lines joined, no space after the colon.
    assert reader.feed(b': keep-alive\r\n\r\nevent: error\r\ndata: {"x":\r') == []
    assert reader.feed(b"\ndata:1}\r\n\r\n") == [("error", b'{"x":\n1}')]
    assert reader.feed(b"data: [DONE]\r\r") == [(None, b"[DONE]")]
    assert reader.feed(b"id: 7\nretry: 10\n\n") == []  # an event without data dispatches nothing


# ---- the light client on canned streams -------------------------------------------------------------
def _chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    body = {"id": "c", "object": "chat.completion.chunk", "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


def _send(parts: list[bytes], status: int = 200, client: str = "light", **options) -> RequestRecord:
    """One chat request against a transport that answers ``parts`` (one read each)."""

    async def stream():
        for part in parts:
            yield part

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert body["stream"] and body["ignore_eos"] and body["max_tokens"] == 4 and body["seed"] == 3
        assert request.headers["authorization"] == "Bearer k"
        return httpx.Response(status, headers={"content-type": "text/event-stream"}, content=stream())

    argv = ["--base-url", "http://bench.local", "--model", "m", "--api-key", "k", "--client", client,
            "--extra-body", '{"seed": 3}', *options.get("argv", [])]  # fmt: skip
    args = parse_args(argv)

    async def run() -> RequestRecord:
        http = make_client(args, 1, transport=httpx.MockTransport(handler))
        record = RequestRecord(index=0)
        await http.send(args, BenchRequest("hi", None, 4, prompt_tokens=2), record, 0.0)
        await http.close()
        return record

    return asyncio.run(run())


USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


@pytest.mark.parametrize("client", ["light", "openai"])
def test_a_stream_with_text_reasoning_and_tool_calls(client):
    call = {"index": 0, "id": "t", "type": "function", "function": {"name": "f", "arguments": '{"x"'}}
    parts = [_chunk({"role": "assistant", "content": ""}), _chunk({"reasoning_content": "hm"}),
             _chunk({"content": "A"}) + _chunk({"tool_calls": [call]}), _chunk({"content": "B"}, "stop"),
             _chunk(usage=USAGE) + b"data: [DONE]\n\n"]  # fmt: skip
    record = _send(parts, client=client)
    assert record.status == "successful" and record.error == ""
    assert record.generated_text == 'hmAf{"x"B' and record.finish_reason == "stop"
    assert record.output_tokens == 4 and record.output_tokens_source == "usage" and record.prompt_tokens == 5
    assert len(record.itl_s) == 3 and 0 < record.ttft_s <= record.e2el_s


@pytest.mark.parametrize("client", ["light", "openai"])
def test_an_error_event_in_the_stream(client):
    error = b'data: {"error": {"message": "engine failed", "type": "internal_error", "code": 500}}\n\n'
    record = _send([_chunk({"content": "A"}), error], client=client)
    assert record.status == "errored" and "engine failed" in record.error
    assert record.ttft_s is not None  # what arrived before the error is still timed


def test_an_error_event_by_name():
    record = _send([b'event: error\ndata: {"message": "overloaded"}\n\n'])
    assert record.status == "errored" and record.error == "error event: overloaded"


@pytest.mark.parametrize("client", ["light", "openai"])
@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error": {"message": "bad max_tokens", "type": "invalid_request_error"}}', "HTTP 400: bad max_tokens"),
        (b'{"detail": "Not Found"}', "HTTP 400: Not Found"),
        (b"plain words", "HTTP 400: plain words"),
    ],
)
def test_http_errors_carry_the_servers_message(client, body, message):
    record = _send([body], status=400, client=client)
    assert record.status == "errored"
    if client == "openai" and not body.startswith(b"{"):  # the SDK keeps only the status of a text body
        assert record.error.startswith("HTTP 400")
    else:
        assert record.error == message
    assert record.ttft_s is None and record.output_tokens == 0


def test_a_stream_without_finish_reason_is_incomplete_and_one_without_text_errored():
    record = _send([_chunk({"content": "A"}), _chunk({"content": "B"}), b"data: [DONE]\n\n"])
    assert record.status == "incomplete" and "finish_reason" in record.error
    assert record.output_tokens == 2 and record.output_tokens_source == "chunks"
    record = _send([_chunk({"content": ""}, "stop"), _chunk(usage=USAGE)])
    assert record.status == "errored" and record.error == "the stream carried no generated text"


def test_a_malformed_event_is_an_error():
    record = _send([_chunk({"content": "A"}), b"data: {not json\n\n"])
    assert record.status == "errored" and record.error.startswith("JSONDecodeError")


# ---- ITL split by prefill -----------------------------------------------------------------------------
def _record(start: float, ttft: float | None, itl: list[float], status: str = "successful", end: float = 0.0):
    end = end or (start + (ttft or 0.0) + sum(itl))
    return SimpleNamespace(status=status, start_s=start, end_s=end, ttft_s=ttft, itl_s=itl)


def test_gaps_away_from_prefills_are_decode_only():
    # A decodes from 1.0 with gaps of 0.25; B is prefilling over [1.5, 2.0).
    a = _record(0.0, 1.0, [0.25] * 8)  # chunks at 1.0, 1.25, ..., 3.0
    b = _record(1.5, 0.5, [0.25])
    decode_only, with_prefill = split_itl([a, b])
    # A's gaps (1.25, 1.5] and (2.0, 2.25] only touch B's prefill: decode-only; (1.5, 1.75] and (1.75, 2.0] overlap.
    assert with_prefill == [0.25, 0.25]
    assert len(decode_only) == 6 + 1  # B's own gap (2.0, 2.25] is after its prefill and during none


def test_touching_boundaries_exactly():
    starts, ends = merge([(1.0, 2.0)])
    gap_starts = [0.5, 0.5, 2.0, 1.5, 0.5]
    gap_ends = [1.0, 1.25, 2.5, 1.5, 3.0]
    mask = with_prefill_mask(np.asarray(gap_starts), np.asarray(gap_ends), starts, ends)
    # (0.5, 1.0]: the prefill starts at its end -> apart; (0.5, 1.25] overlaps; (2.0, 2.5]: it ended at the start
    # -> apart; (1.5, 1.5]: an instant strictly inside -> with prefill; (0.5, 3.0] covers it.
    assert mask.tolist() == [False, True, False, True, True]


def test_a_request_that_never_got_a_token_prefills_until_its_end():
    a = _record(0.0, 1.0, [0.5, 0.5, 0.5, 0.5])  # chunks at 1.0, 1.5, 2.0, 2.5, 3.0
    failed = _record(1.75, None, [], status="errored", end=2.25)
    assert prefill_intervals([failed]) == [(1.75, 2.25)]
    decode_only, with_prefill = split_itl([a, failed])
    assert (len(decode_only), len(with_prefill)) == (2, 2)  # (1.5, 2.0] and (2.0, 2.5] meet [1.75, 2.25)


def test_overlapping_prefills_merge_and_own_prefill_does_not_count():
    a = _record(0.0, 1.0, [1.0] * 5)  # chunks at 1, 2, 3, 4, 5, 6
    b = _record(1.5, 1.0, [])  # prefilling [1.5, 2.5)
    c = _record(2.0, 1.5, [])  # prefilling [2.0, 3.5): overlaps b's
    d = _record(4.0, 1.0, [])  # prefilling [4.0, 5.0): touches a's chunks at 4 and 5 only
    starts, ends = merge(prefill_intervals([a, b, c, d]))
    assert starts.tolist() == [0.0, 1.5, 4.0] and ends.tolist() == [1.0, 3.5, 5.0]  # a's own [0, 1) stays
    decode_only, with_prefill = split_itl([a, b, c, d])
    # (1,2], (2,3], (3,4] meet b or c; (4,5] is d's prefill; (5,6] is clear.
    assert len(with_prefill) == 4 and len(decode_only) == 1


def test_no_prefills_at_all():
    one = np.asarray([1.0])
    assert with_prefill_mask(one, one + 0.5, *merge([])).tolist() == [False]
    assert split_itl([_record(0.0, 1.0, [0.5, 0.5])]) == ([0.5, 0.5], [])


def test_summary_reports_the_split_and_the_ratios():
    args = parse_args(["--base-url", "http://h", "--model", "m", "--offline-step-ms", "0.2", "--num-prompts", "2"])
    first = RequestRecord(0, status="successful", start_s=0.0, end_s=1.75, ttft_s=1.0, e2el_s=1.75,
                          itl_s=[0.25, 0.25, 0.25], output_tokens=4)  # fmt: skip
    second = RequestRecord(1, status="successful", start_s=1.1, end_s=1.6, ttft_s=0.3, e2el_s=0.5,
                           itl_s=[0.1, 0.1], output_tokens=3)  # fmt: skip
    result = summarize([first, second], 2.0, args, "synthetic")
    # The second request prefills over [1.1, 1.4): the first's gap (1.0, 1.25] and (1.25, 1.5] meet it.
    assert result["itl_with_prefill_count"] == 2 and result["itl_decode_only_count"] == 3
    assert result["mean_itl_decode_only_ms"] == pytest.approx(1000 * (0.25 + 0.1 + 0.1) / 3)
    assert result["mean_itl_with_prefill_ms"] == pytest.approx(250.0)
    assert result["itl_decode_only_over_offline_step"] == pytest.approx(result["mean_itl_decode_only_ms"] / 0.2)
    assert result["tpot_over_offline_step"] == pytest.approx(result["mean_tpot_ms"] / 0.2)
