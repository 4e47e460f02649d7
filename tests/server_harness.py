"""Start the real dsinfer server on 127.0.0.1 (uvicorn in a background thread) for tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import uvicorn

from dsinfer.config import EngineConfig
from dsinfer.server.launch import ServeOptions, build_server


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(model_dir, engine_config: EngineConfig | None = None, **options):
    """Yield the base URL of a live server; shut it down (and its engine thread) afterwards.

    ``model_dir`` None serves the embedded default model, as ``dsinfer serve`` without a path does.
    """
    # The listening socket is bound before anything else starts, and uvicorn serves on it: a port only named here
    # could be taken in between (the ranks' rendezvous picks a free port too) and the server would never answer.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    options.setdefault("served_model_name", "tiny")  # None: the name ``dsinfer serve`` would choose
    # Most tests send bodies without ``model``, as vLLM allows; the API-edge tests pass True (the server's default).
    options.setdefault("require_model", False)
    serve_options = ServeOptions(model=None if model_dir is None else str(model_dir), port=port, **options)
    config = engine_config or EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024)
    app, engine = build_server(serve_options, config)
    engine.start()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        time.sleep(0.05)
    try:
        yield base, engine
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.stop()
        listener.close()
        forget_endpoints()


def forget_endpoints() -> None:
    """Empty FastAPI's module-level caches of endpoint callables. They keep every app's route functions, and with
    them each test server's engine (its model and a 512 MiB cache), for the rest of the process: a pytest worker
    that starts dozens of servers grew past 12 GB and was killed for memory. A served process builds one app."""
    from fastapi.dependencies import models

    for name in ("_is_gen_callable_cached", "_is_async_gen_callable_cached", "_is_coroutine_callable_cached"):
        cached = getattr(models, name, None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()


def metric_value(base: str, name: str) -> float:
    """Sum of a Prometheus metric's samples as the server exports them."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise KeyError(name)
    return total
