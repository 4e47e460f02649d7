"""``dsinfer serve`` as a real process: it drains in-flight streams on SIGTERM, then exits cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
from server_harness import free_port


def test_sigterm_drains_in_flight_requests_then_exits(tiny_checkpoint, tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "dsinfer.cli", "serve", str(tiny_checkpoint), "--port", str(port),
               "--served-model-name", "tiny", "--max-model-len", "512", "--device", "cpu"]  # fmt: skip
    log = open(tmp_path / "server.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 60, "ignore_eos": True, "stream": True}
        finish_reasons, chunks = [], 0
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks += 1
                if chunks == 2:
                    process.send_signal(signal.SIGTERM)  # mid-stream
                choice = json.loads(line[6:])["choices"][0]
                if choice["finish_reason"]:
                    finish_reasons.append(choice["finish_reason"])
        assert finish_reasons == ["length"]  # the stream ran to its end despite the signal
        assert process.wait(timeout=60) == 0
        try:
            httpx.get(f"{base}/health", timeout=1)
            raise AssertionError("the server still answers after SIGTERM")
        except httpx.HTTPError:
            pass
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
