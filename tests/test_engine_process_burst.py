"""Many streaming requests at the same instant, the engine in its own process: every one of them finishes.

The API process writes each request to the engine process's pipe from its event loop. uvloop (uvicorn's loop
where it is installed) makes a descriptor it watches non-blocking, and the pipe is watched for the engine's
reports: a burst of long prompts then fills the pipe faster than the engine reads it, between two steps. Such a
write once failed with ``BlockingIOError`` and the request was dropped, its stream open forever. The tests make
the pipe non-blocking and small themselves, so that they need no uvloop and fill it with a few short prompts.
"""

from __future__ import annotations

import asyncio
import os
import socket

import httpx
import pytest
from server_harness import running_server

from dsinfer.config import EngineConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024)
REQUESTS, OUTPUT_TOKENS, DEADLINE_S = 16, 4, 120.0


def _squeeze_pipes(engine) -> None:
    """The API process's end of every engine pipe as uvloop leaves it (non-blocking), with a small send buffer."""
    for conn in engine.engine._conns.values():
        os.set_blocking(conn.fileno(), False)
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)


async def _burst(base: str, endpoint: str, words: int) -> list[str | None]:
    """Send ``REQUESTS`` streaming requests at once; each one's finish reason (None: the stream had none)."""
    prompt = " ".join(f"word{i}" for i in range(words))
    body = {"model": "tiny", "stream": True, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "ignore_eos": True}
    body |= {"messages": [{"role": "user", "content": prompt}]} if endpoint == "chat" else {"prompt": prompt}
    url = f"{base}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"
    limits = httpx.Limits(max_connections=REQUESTS, max_keepalive_connections=REQUESTS)
    async with httpx.AsyncClient(timeout=DEADLINE_S, limits=limits) as client:

        async def one() -> str | None:
            finish = None
            async with client.stream("POST", url, json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"finish_reason":"' in line.replace(" ", ""):
                        finish = "length" if '"length"' in line else "other"
            return finish

        return await asyncio.wait_for(asyncio.gather(*(one() for _ in range(REQUESTS))), DEADLINE_S)


def test_a_burst_of_streams_all_finish_through_a_full_pipe(tiny_checkpoint):
    with running_server(tiny_checkpoint, CONFIG, engine_process=True) as (base, engine):
        _squeeze_pipes(engine)
        for words in (30, 60):  # a few rounds: a race shows in some and not others
            finishes = asyncio.run(_burst(base, "chat", words))
            assert finishes == ["length"] * REQUESTS
            assert not engine.engine.requests
