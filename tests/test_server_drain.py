"""``--drain-timeout``: after SIGTERM, requests that need longer than the timeout are ended cleanly: a stream
gets an error event and ``data: [DONE]`` (never a truncated line), a non-streaming request a 503, and the
process exits 0 soon after the deadline."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
from server_harness import free_port

from dsinfer.server.drain import BACKSTOP_SECONDS

DRAIN_TIMEOUT = 1.5
LONG = {"model": "tiny", "max_tokens": 1500, "ignore_eos": True}  # many seconds on a CPU


def start_server(checkpoint, port: int, log) -> subprocess.Popen:
    command = [sys.executable, "-m", "dsinfer.cli", "serve", str(checkpoint), "--port", str(port),
               "--served-model-name", "tiny", "--max-model-len", "2048", "--device", "cpu",
               "--drain-timeout", str(DRAIN_TIMEOUT)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise AssertionError("the server did not start")


def test_streams_longer_than_the_drain_timeout_end_with_an_error_and_done(tiny_checkpoint, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "w") as log:
        process = start_server(tiny_checkpoint, port, log)
        try:
            streams: dict[int, list[str]] = {}
            started = threading.Barrier(4)  # three streams and the main thread
            plain: list[httpx.Response] = []

            def stream(index: int) -> None:
                route, body = (("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
                               if index % 2 else ("completions", {"prompt": "Once"}))  # fmt: skip
                lines = streams.setdefault(index, [])
                with httpx.stream("POST", f"{base}/v1/{route}", json={**LONG, **body, "stream": True},
                                  timeout=60) as response:  # fmt: skip
                    for line in response.iter_lines():
                        lines.append(line)
                        if line.startswith("data: ") and sum(x.startswith("data: ") for x in lines) == 2:
                            started.wait(timeout=60)  # generation is under way

            def non_streaming() -> None:
                plain.append(httpx.post(f"{base}/v1/completions", json={**LONG, "prompt": "Hi"}, timeout=60))

            threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
            threads.append(threading.Thread(target=non_streaming))
            for thread in threads:
                thread.start()
            started.wait(timeout=60)
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            for thread in threads:
                thread.join(timeout=60)
            ended = time.monotonic() - signalled
            assert process.wait(timeout=60) == 0
            assert DRAIN_TIMEOUT <= ended < DRAIN_TIMEOUT + BACKSTOP_SECONDS, ended  # ended by us, not by uvicorn

            for index, lines in streams.items():
                data = [line for line in lines if line.startswith("data: ")]
                assert data[-1] == "data: [DONE]", (index, data[-3:])
                events = [json.loads(line[6:]) for line in data[:-1]]  # every line is whole JSON
                assert "error" in events[-1] and "drain-timeout" in events[-1]["error"]["message"], events[-1]
                assert events[-1]["error"]["type"] == "server_error"
                assert not any(e.get("choices") and e["choices"][0].get("finish_reason") for e in events)
            assert plain[0].status_code == 503 and "drain-timeout" in plain[0].json()["error"]["message"]
        finally:
            if process.poll() is None:
                process.kill()
