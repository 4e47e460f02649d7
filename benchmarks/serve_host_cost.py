"""Host cost per step of serving with an engine process, on each side of its pipe, and ITL over HTTP against the
offline step.

    python benchmarks/serve_host_cost.py engine           # the engine process's side of a decode step, in µs
    python benchmarks/serve_host_cost.py api              # the API process's side, fed recorded reports
    python benchmarks/serve_host_cost.py e2e              # the server on loopback: ITL against the offline step
    python benchmarks/serve_host_cost.py e2e --device-ms 3.4   # the forward as 3.4 ms without the Python lock
    python benchmarks/serve_host_cost.py client           # dsinfer bench serve's own CPU per chunk, each client
    python benchmarks/serve_host_cost.py itl --base-url http://127.0.0.1:8123 --model slice --input-len 8192 \
        --output-len 1024                                 # ITL of a running server, read by the light client
    PYTHONPATH=../older-checkout python benchmarks/serve_host_cost.py engine api   # the same against other code

All parts use the tiny checkpoint (written to a temporary directory) and ``--requests`` greedy requests (16) that
decode together, as ``dsinfer bench serve --max-concurrency 16`` keeps them.

``engine``: what the engine process does per decode step, with every request as the API process sends it
(:meth:`RankedEngine.add_request`'s own message): ``engine.step()`` (the forward replaced by constant logits, so
what is left is host work, text included where the engine makes it), building the step's report
(:class:`~dsinfer.parallel.engine_loop.EngineLoop`'s deltas and counters) and sending it down a pipe (pickling
included; another process drains it). Medians over the decode steps of every request, in wall time and in the
thread's CPU time (steadier on a busy machine).

``api``: the API process's side. The reports of such a run are recorded, then a feeder process writes them into
the pipe of a :class:`RankedEngine` that has no engine process, one every ``--period-ms`` (a decode step of the
H200 run), while ``--requests`` streams read them as chunks (``--endpoint``: chat, or ``/v1/completions``) through
:class:`AsyncEngine` and the endpoint's chunk builder, as the server does (minus HTTP). It reports the API
process's CPU per step, the delay from a report's write to its output reaching the stream, and the gaps between
chunks of one stream (as vLLM's ``benchmark_serving`` counts ITL): their median near the period means one delivery
per step; a median far below it means steps arrive two at a time.

``e2e``: ``dsinfer serve``'s app (engine process, as served by default) on loopback with the tiny model, the
requests streamed by another process that reads the server-sent events as vLLM's client does (a gap per chunk
that carries choices); its median ITL against the offline engine's median decode step measured the same way
(the period from one ``step()`` to the next, same model, requests, forward and overlap setting). With
``--device-ms`` the forward is a sleep of that long after constant logits (a GPU's step holds no Python lock; the
engine overlaps steps as on CUDA), so the ratio shows what serving adds to a GPU-like step. On a machine of few
cores the engine process, the server and the client take CPU from each other; ``--pin`` gives the engine process
a core of its own, as a GPU host does.

``client``: ``dsinfer bench serve``'s own request function, for each of ``--clients`` (``light``: httpx and its own
server-sent-events parser, the default; ``openai``: openai's client over httpx, a pydantic chunk each), reading
``--requests`` streams of ``--output-len`` chat chunks served from memory, one chunk per read: its CPU per chunk,
against what 16 streams at one chunk per decode step need (docs/perf.md, history: the serving host's cost).

``itl``: the light client of ``e2e`` against a server already running at ``--base-url``: ITL as vLLM counts it,
without the openai client's parsing between the socket and the clock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import pickle
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_step  # noqa: E402  (constant_forward, the engine-process hook)

from dsinfer.config import EngineConfig, ModelConfig  # noqa: E402
from dsinfer.engine.engine import LLMEngine  # noqa: E402
from dsinfer.engine.request_check import RequestChecker  # noqa: E402
from dsinfer.models.loader import load_model  # noqa: E402
from dsinfer.models.tiny import make_tiny_checkpoint  # noqa: E402
from dsinfer.parallel import ranked_engine  # noqa: E402
from dsinfer.parallel.engine_loop import EngineLoop  # noqa: E402
from dsinfer.parallel.messages import StepReport  # noqa: E402
from dsinfer.sampling_params import SamplingParams  # noqa: E402
from dsinfer.tokenizer import Tokenizer  # noqa: E402


def prompts(requests: int, input_len: int) -> list[list[int]]:
    return [[5 + (i * 7 + j) % 200 for j in range(input_len)] for i in range(requests)]


def config_for(args, overlap: bool = False) -> EngineConfig:
    return EngineConfig(max_num_seqs=args.requests, max_model_len=args.input_len + args.output_len + 64,
                        async_scheduling=overlap)  # fmt: skip


def bare_ranked_engine(tokenizer: Tokenizer, model_config: ModelConfig, config: EngineConfig, conn) -> object:
    """A :class:`RankedEngine` whose one rank is the other end of ``conn`` (no process is started): the API
    process's code as it is, fed by whatever writes into the pipe."""
    engine = ranked_engine.RankedEngine.__new__(ranked_engine.RankedEngine)
    max_model_len = config.resolved_max_model_len(model_config)
    engine.__dict__.update(
        tokenizer=tokenizer, config=config, parallel=SimpleNamespace(is_multi_rank=False, world_size=1),
        model=ranked_engine._ModelInfo(model_config), max_model_len=max_model_len,
        checker=RequestChecker(tokenizer, model_config, max_model_len),
        _tracked={}, _loads={0: ranked_engine.RankLoad(num_blocks=1 << 20)}, failure=None, _closing=False,
        _inbox=__import__("queue").SimpleQueue(), _conns={0: conn}, _writers={0: ranked_engine.FrameWriter(conn)},
        _processes={}, _receiver=None, _attached=None,
        balancer=ranked_engine.RequestBalancer(1, 64, config.step_token_budget),
    )  # fmt: skip
    return engine


def _drain(conn: Connection) -> None:
    try:
        while True:
            conn.recv_bytes()
    except EOFError:
        pass


def _median_us(values: list[float]) -> float:
    return round(statistics.median(values) * 1e6, 1)


def engine_side(args, directory: str, record: list | None = None) -> dict:
    """The engine process's work per decode step; ``record`` gets every report's pickled frame."""
    model = load_model(directory, progress=False)
    host_step.constant_forward(type(model))
    tokenizer = Tokenizer.from_dir(directory)
    config = config_for(args)
    engine = LLMEngine(model, tokenizer, config)
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    sent: list = []
    api = bare_ranked_engine(tokenizer, model.config, config, None)
    api._send = lambda rank, message: sent.append(message)
    # Chat, Responses and Messages requests want no text from the engine (the protocol library decodes the ids).
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True,
                            detokenize=args.endpoint == "completions")  # fmt: skip
    for i, prompt in enumerate(prompts(args.requests, args.input_len)):
        api.add_request(prompt, params, request_id=f"req-{i}")  # what the API process sends, as it builds it
    drain = context.Process(target=_drain, args=(theirs,), daemon=True)
    drain.start()
    theirs.close()
    loop = EngineLoop(SimpleNamespace(rank=0), ours, model, engine)
    report = StepReport(0)
    for message in sent:
        loop._apply(message, report)
    times: dict[str, list[float]] = {name: [] for name in ("step", "report", "send")}
    cpu: dict[str, list[float]] = {name: [] for name in ("step", "report", "send")}
    sizes = []
    while engine.has_unfinished_requests():
        clocks = [(time.perf_counter(), time.thread_time())]
        outputs = engine.step()
        clocks.append((time.perf_counter(), time.thread_time()))
        report.deltas = [loop._delta(output) for output in outputs]
        report.load = loop._load()
        clocks.append((time.perf_counter(), time.thread_time()))
        ours.send(report)
        clocks.append((time.perf_counter(), time.thread_time()))
        if record is not None:
            record.append(pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL))
        decode = all(len(d.completions) == 1 and len(d.completions[0].new_token_ids) == 1 for d in report.deltas)
        if decode and len(report.deltas) == args.requests and not any(d.finished for d in report.deltas):
            for index, name in enumerate(("step", "report", "send")):
                times[name].append(clocks[index + 1][0] - clocks[index][0])
                cpu[name].append(clocks[index + 1][1] - clocks[index][1])
            sizes.append(len(pickle.dumps(report)))
        report = StepReport(0)
    ours.close()
    drain.join(timeout=10)
    engine.close()
    rank_params = sent[0].params
    return {"part": "engine", "endpoint": args.endpoint, "requests": args.requests, "decode_steps": len(sizes),
            "engine_detokenizes": bool(rank_params.detokenize),
            **{f"{name}_us": _median_us(values) for name, values in times.items()},
            **{f"{name}_cpu_us": _median_us(values) for name, values in cpu.items()},
            "report_bytes": int(statistics.median(sizes))}  # fmt: skip


# ---- the API process's side ---------------------------------------------------------------------
def _feed(conn: Connection, frames: list[bytes], period_s: float, requests: int, results: Connection) -> None:
    """Wait for every request, then write one recorded report every ``period_s``; send the write times back."""
    for _ in range(requests):
        conn.recv()
    times, start = [], time.perf_counter() + 0.05
    for index, frame in enumerate(frames):
        pause = start + index * period_s - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        times.append(time.perf_counter())
        conn.send_bytes(frame)
    results.send(times)
    try:  # the API process may still abort; keep the pipe open until it closes its end
        while True:
            conn.recv()
    except (EOFError, OSError):
        pass


def _frame_of_token(frames: list[bytes]) -> dict[tuple[str, int], int]:
    """The index of the report that brought each request's n-th token (n counted from 1)."""
    counts: dict[str, int] = {}
    where = {}
    for index, frame in enumerate(frames):
        for delta in pickle.loads(frame).deltas:
            for change in delta.completions:
                counts[delta.request_id] = counts.get(delta.request_id, 0) + len(change.new_token_ids)
                where[(delta.request_id, counts[delta.request_id])] = index
    return where


def api_side(args, directory: str) -> dict:
    import deepseek_recipe as recipe

    from dsinfer.chat.format import ChatFormat
    from dsinfer.chat.stream import ChoiceStream
    from dsinfer.server.app import ServerSettings, _completion_chunks
    from dsinfer.server.async_engine import AsyncEngine
    from dsinfer.server.chat_api import _chunks as chat_chunks
    from dsinfer.server.metrics import ServerMetrics
    from dsinfer.server.protocol import CompletionRequest
    from dsinfer.server.response_stream import Run, sse_frame
    from dsinfer.server.streams import merged

    frames: list[bytes] = []
    engine_side(args, directory, record=frames)
    where = _frame_of_token(frames)
    tokenizer, model_config = Tokenizer.from_dir(directory), ModelConfig.from_file(directory)
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    results_in, results_out = context.Pipe(duplex=False)
    feeder = context.Process(target=_feed, args=(theirs, frames, args.period_ms / 1e3, args.requests, results_out),
                             daemon=True)  # fmt: skip
    feeder.start()
    theirs.close()
    api = bare_ranked_engine(tokenizer, model_config, config_for(args), ours)
    engine = AsyncEngine(api, ServerMetrics("tiny"))
    if not callable(getattr(api, "attach", None)):  # older code: its receiver thread read the pipe
        api._receiver = threading.Thread(target=api._receive, name="dsinfer-ranks", daemon=True)
        api._receiver.start()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    body = CompletionRequest(model="tiny", prompt="x", max_tokens=args.output_len, stream=True)
    settings = ServerSettings("tiny", max_model_len=args.input_len + args.output_len + 64)
    chat_format = ChatFormat(tokenizer, "v4", "tiny")
    prepared = chat_format.prepare("chat", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
    chat_params = replace(params, structured_output=prepared.structured_output, detokenize=False)  # as chat_api
    arrivals: dict[str, list[float]] = {}
    delivered: dict[tuple[str, int], float] = {}  # (request, its tokens so far): when the stream got that output

    async def timed(request_id: str, outputs):
        async for output in outputs:
            delivered[(request_id, len(output.outputs[0].token_ids))] = time.perf_counter()
            yield output

    def chunks(index: int, prompt: list[int]):
        """The server's chunks of one request, as its endpoint builds them (HTTP aside)."""
        if args.endpoint == "completions":
            outputs = timed(f"req-{index}", engine.generate(prompt, params))
            return _completion_chunks(merged([outputs]), body, params, settings, tokenizer)
        generator = recipe.ChatCompletionRequest.chunk_generator(prepared.request, f"chatcmpl-{index}", "tiny")
        outputs = timed(f"req-{index}", engine.generate(prompt, chat_params))
        run = Run(outputs, [ChoiceStream(chat_format, prepared, generator)])
        return chat_chunks(run, False, f"chatcmpl-{index}", "tiny", 0)

    async def stream(index: int, prompt: list[int]) -> None:
        times = arrivals[f"req-{index}"] = []  # the engine names requests in the order they come
        async for chunk in chunks(index, prompt):
            sse_frame(None, chunk)
            times.append(time.perf_counter())

    async def main() -> tuple[float, dict]:
        engine.start()
        if getattr(engine, "loop_driven", False):
            engine.attach()
        cpu, threads = time.process_time(), host_step.thread_cpu_s()
        await asyncio.gather(*(stream(i, p) for i, p in enumerate(prompts(args.requests, args.input_len))))
        after = host_step.thread_cpu_s()
        per_thread = {name: after[name] - threads.get(name, 0.0) for name in after}
        return time.process_time() - cpu, per_thread

    cpu_s, per_thread = asyncio.run(main())
    sent = results_in.recv()
    engine.stop()
    feeder.join(timeout=10)
    steps = len(frames)
    gaps = []
    for times in arrivals.values():
        gaps += [b - a for a, b in zip(times, times[1:], strict=False)]
    delays = [at - sent[where[key]] for key, at in delivered.items()]
    period = args.period_ms / 1e3
    return {"part": "api", "endpoint": args.endpoint, "requests": args.requests, "reports": steps,
            "period_ms": args.period_ms,
            "loop_reads_pipe": bool(getattr(engine, "loop_driven", False)),
            "api_cpu_us_per_step": round(cpu_s / steps * 1e6, 1),
            "thread_cpu_us_per_step": {k: round(v / steps * 1e6, 1) for k, v in per_thread.items() if v > 0},
            "delivery_delay_ms": {"median": round(statistics.median(delays) * 1e3, 3),
                                  "p90": round(statistics.quantiles(delays, n=10)[-1] * 1e3, 3)},
            "itl_ms": {"median": round(statistics.median(gaps) * 1e3, 3),
                       "mean": round(statistics.mean(gaps) * 1e3, 3)},
            "gaps_under_half_period": round(sum(g < period / 2 for g in gaps) / len(gaps), 3)}  # fmt: skip


# ---- end to end --------------------------------------------------------------------------------
def _read_streams(port: int, endpoint: str, requests: int, input_len: int, output_len: int,
                  results: Connection | None, host: str = "127.0.0.1", model: str = "tiny") -> list:  # fmt: skip
    """Stream every request and time its chunks as vLLM's client does: a gap per chunk that carries choices (all
    the chunks one read of the socket returns share its time)."""

    async def one(index: int) -> list[float]:
        fields = {"model": model, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True}
        if endpoint == "completions":
            fields["prompt"] = prompts(requests, input_len)[index]
        else:  # about input_len tokens of text
            fields["messages"] = [{"role": "user", "content": f"{index}" + " the" * (input_len - 8)}]
        body = json.dumps(fields).encode()
        reader, writer = await asyncio.open_connection(host, port)
        path = b"/v1/completions" if endpoint == "completions" else b"/v1/chat/completions"
        writer.write(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     b"content-length: %d\r\n\r\n%s" % (path, host.encode(), len(body), body))  # fmt: skip
        times, pending = [], b""
        while data := await reader.read(1 << 16):
            now = time.perf_counter()
            pending += data
            *events, pending = pending.split(b"\n\n")
            for event in events:
                start = event.find(b"data: {")
                if start >= 0 and json.loads(event[start + 6 :]).get("choices"):
                    times.append(now)
        writer.close()
        return times

    async def run() -> list[list[float]]:
        return await asyncio.gather(*(one(i) for i in range(requests)))

    streams = asyncio.run(run())
    if results is not None:
        results.send(streams)
    return streams


def itl_of_server(args, directory: str) -> dict:
    """ITL of a server already running at ``--base-url`` (e.g. the H200 slice), read by the light client."""
    host, _, port = args.base_url.removeprefix("http://").rstrip("/").partition(":")
    start = time.perf_counter()
    streams = _read_streams(int(port or 80), args.endpoint, args.requests, args.input_len, args.output_len, None,
                            host, args.model)  # fmt: skip
    gaps = [b - a for times in streams for a, b in zip(times, times[1:], strict=False)]
    tenths = statistics.quantiles(gaps, n=10)
    return {"part": "itl", "endpoint": args.endpoint, "requests": args.requests, "input_len": args.input_len,
            "output_len": args.output_len, "chunks": sum(map(len, streams)),
            "itl_ms": {"median": round(statistics.median(gaps) * 1e3, 3), "mean": round(statistics.mean(gaps) * 1e3, 3),
                       "p10": round(tenths[0] * 1e3, 3), "p90": round(tenths[-1] * 1e3, 3)},
            "gaps_under_1ms": round(sum(g < 1e-3 for g in gaps) / len(gaps), 3),
            "duration_s": round(time.perf_counter() - start, 2)}  # fmt: skip


def offline_step_ms(args, directory: str, overlap: bool) -> float:
    """The offline engine's median decode step: the period from one ``step()`` to the next."""
    model = load_model(directory, progress=False)
    if args.device_ms:
        host_step.constant_forward(type(model), args.device_ms)
    engine = LLMEngine(model, Tokenizer.from_dir(directory), config_for(args, overlap))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for prompt in prompts(args.requests, args.input_len):
        engine.add_request(prompt, params)
    ends = []
    while engine.has_unfinished_requests():
        engine.step()
        ends.append(time.perf_counter())
    engine.close()
    periods = [b - a for a, b in zip(ends, ends[1:], strict=False)]
    decode = periods[len(periods) // 8 : -len(periods) // 8]  # past the prefills, before the first requests end
    return statistics.median(decode) * 1e3


def end_to_end(args, directory: str) -> dict:
    import uvicorn

    from dsinfer.server.launch import ServeOptions, build_server

    overlap = args.device_ms > 0
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine process's torch threads (a fresh interpreter)
    if args.device_ms:  # read by the engine process when it imports this script (host_step.patch_engine_process)
        records = tempfile.mkdtemp(prefix="serve-host-cost-")
        settings = {"device_ms": args.device_ms, "threads": args.threads, "out": records}
        os.environ[host_step.ENGINE_PROCESS_ENV] = json.dumps(settings)
    options = ServeOptions(model=directory, port=args.port, served_model_name="tiny", log_level="warning",
                           engine_process=True)  # fmt: skip
    app, engine = build_server(options, config_for(args, overlap))
    everything = os.sched_getaffinity(0)
    if args.pin:  # the engine process alone on the last core (as on a GPU host), the rest share the others
        os.sched_setaffinity(engine.engine.pids[0], {max(everything)})
        os.sched_setaffinity(0, everything - {max(everything)})
    engine.start()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True, name="http").start()
    while not server.started:
        time.sleep(0.05)
    context = multiprocessing.get_context("spawn")
    results_in, results_out = context.Pipe(duplex=False)
    client = context.Process(target=_read_streams,
                             args=(args.port, args.endpoint, args.requests, args.input_len, args.output_len,
                                   results_out))  # fmt: skip
    client.start()
    streams = results_in.recv()
    client.join()
    server.should_exit = True
    time.sleep(0.5)
    engine.stop()
    app.state.llm.close()
    gaps = [b - a for times in streams for a, b in zip(times, times[1:], strict=False)]
    if args.pin:
        os.sched_setaffinity(0, {max(everything)})
    offline = offline_step_ms(args, directory, overlap)
    os.sched_setaffinity(0, everything)
    itl = statistics.median(gaps) * 1e3
    return {"part": "e2e", "endpoint": args.endpoint, "requests": args.requests, "input_len": args.input_len,
            "output_len": args.output_len,
            "device_ms": args.device_ms, "overlap": overlap, "pinned": args.pin, "chunks": sum(map(len, streams)),
            "itl_ms": {"median": round(itl, 3), "mean": round(statistics.mean(gaps) * 1e3, 3),
                       "p10": round(statistics.quantiles(gaps, n=10)[0] * 1e3, 3)},
            "offline_step_ms": round(offline, 3), "median_itl_over_offline_step": round(itl / offline, 3)}  # fmt: skip


# ---- the benchmark client -----------------------------------------------------------------------
def client_side(args, directory: str) -> dict:
    """``dsinfer bench serve``'s CPU per chunk: its request function (each client of ``--clients``) over
    ``--requests`` concurrent streams of ``--output-len`` chat chunks each, served from memory (no server, no
    network) one chunk per read, as a server that sends a chunk per step delivers them, as fast as it reads."""
    import httpx

    from dsinfer.bench.datasets import BenchRequest
    from dsinfer.bench.serving import parse_args
    from dsinfer.bench.serving_client import RequestRecord, make_client

    chunk = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny","choices":'
             b'[{"index":0,"delta":{"content":"ke"},"logprobs":null,"finish_reason":null}]}\n\n')  # fmt: skip
    last = ('data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny","choices":'
            '[{"index":0,"delta":{"content":"ke"},"logprobs":null,"finish_reason":"length"}]}\n\n'
            'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"tiny","choices":[],'
            '"usage":{"prompt_tokens":8,"completion_tokens":%d,"total_tokens":%d}}\n\ndata: [DONE]\n\n')  # fmt: skip
    last = (last % (args.output_len, args.output_len + 8)).encode()

    async def reads():
        for _ in range(args.output_len - 1):
            yield chunk
            await asyncio.sleep(0)  # the next read waits for the event loop, as a socket's does
        yield last

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=reads())

    results = {"part": "client", "streams": args.requests, "chunks": args.requests * args.output_len}
    for name in args.clients.split(","):
        bench_args = parse_args(["--base-url", "http://bench.local", "--model", "tiny", "--output-len",
                                 str(args.output_len), "--disable-tqdm", "--client", name])  # fmt: skip

        async def run() -> list:
            client = make_client(bench_args, args.requests, transport=httpx.MockTransport(handler))  # noqa: B023
            request = BenchRequest(None, [{"role": "user", "content": "Hi"}], args.output_len)
            records = [RequestRecord(index=i) for i in range(args.requests)]
            await asyncio.gather(*(client.send(bench_args, request, r, 0.0) for r in records))  # noqa: B023
            await client.close()
            return records

        start, cpu = time.perf_counter(), time.process_time()
        records = asyncio.run(run())
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        assert all(r.status == "successful" and r.output_tokens == args.output_len for r in records), records[0]
        results[name] = {"cpu_us_per_chunk": round(cpu / results["chunks"] * 1e6, 1),
                         "chunks_per_s_one_core": round(results["chunks"] / cpu), "wall_s": round(wall, 2)}  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("parts", nargs="+", choices=["engine", "api", "e2e", "client", "itl"])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="itl: the running server")
    parser.add_argument("--model", default="tiny", help="itl: the served model name")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                        help="the requests' endpoint (chat: as 'dsinfer bench serve' by default)")  # fmt: skip
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--period-ms", type=float, default=3.38, help="api: one report every this long")
    parser.add_argument("--device-ms", type=float, default=0.0, help="e2e: the forward as a sleep of this long")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--pin", action="store_true",
                        help="e2e: the engine process alone on the last CPU (on a GPU host it has a core of its "
                        "own), the server and the client on the others; the offline engine on that CPU")  # fmt: skip
    parser.add_argument("--port", type=int, default=18561)
    parser.add_argument("--clients", default="light,openai",
                        help="client: dsinfer bench serve's --client values to measure, comma-separated")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as directory:
        make_tiny_checkpoint(directory, arch="v4")
        for part in args.parts:
            parts = {"engine": engine_side, "api": api_side, "e2e": end_to_end, "client": client_side,
                     "itl": itl_of_server}  # fmt: skip
            run = parts[part]
            print(json.dumps(run(args, directory)), flush=True)


if __name__ == "__main__":
    main()


if __name__ == "__mp_main__" and host_step.ENGINE_PROCESS_ENV in os.environ:
    host_step.patch_engine_process()  # this script imported by the engine process (or the client, which never steps)
