"""``dsinfer serve``: start the engine, start the engine thread, run the HTTP server until SIGTERM / Ctrl-C.

The engine runs in a process of its own by default (one engine process per rank, :mod:`dsinfer.parallel`), as
vLLM V1's EngineCore does: the API process then holds no weights, and its HTTP and asyncio work never competes
with the engine's step for the Python lock. ``--engine-in-process`` keeps a single rank's engine in this process
(its engine thread steps it directly), as :func:`build_server` does unless ``ServeOptions.engine_process``.
A dead engine process makes /health answer 503, then the server exits 1.

On SIGTERM uvicorn stops accepting connections and waits for in-flight requests (streams included) to finish;
after ``drain_timeout`` seconds the engine ends the rest (a stream gets an error event and ``[DONE]``,
see :mod:`dsinfer.server.drain`); then the engine thread stops, the model releases what it holds outside
itself (V4.1 Engram tables in shared memory, ``--engram-placement host``) and the process exits.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from dsinfer.config import EngineConfig
from dsinfer.engine.gc_heap import freeze_heap
from dsinfer.llm import LLM
from dsinfer.parallel.config import ParallelConfig
from dsinfer.server import DEFAULT_SERVED_MODEL_NAME
from dsinfer.server.app import ServerSettings, build_app
from dsinfer.server.async_engine import AsyncEngine
from dsinfer.server.drain import BACKSTOP_SECONDS, Drain
from dsinfer.server.images import ImageLimits
from dsinfer.server.limits import DEFAULT_MAX_N
from dsinfer.server.metrics import ServerMetrics


@dataclass
class ServeOptions:
    model: str | None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    load_format: str = "auto"  # 'dummy': the directory's config and tokenizer, random weights (dsinfer.models.dummy)
    api_key: str | None = None
    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    expert_placement: str | None = None  # a JSON file of each EP rank's experts (redundant experts)
    request_timeout: float | None = None
    max_queue: int | None = None
    max_n: int = DEFAULT_MAX_N
    drain_timeout: float = 30.0
    log_level: str = "info"
    image_limits: ImageLimits | None = None  # V4.1 with a vision tower: images per request, bytes, pixels
    # One rank: step the engine in a process of its own (``dsinfer serve`` does unless --engine-in-process) rather
    # than in this process's engine thread, which embedding code and tests keep by default, as LLM does.
    engine_process: bool = False


def check_parallelism(options: ServeOptions) -> ParallelConfig:
    """The rank layout of the flags: DP attention x CP must tile the EP group exactly (the DeepInfer layout)."""
    return ParallelConfig(
        options.data_parallel_size, options.expert_parallel_size, options.context_parallel_size,
        options.nnodes, options.node_rank, options.master_addr, options.master_port, options.expert_placement,
    )  # fmt: skip


def build_server(options: ServeOptions, engine_config: EngineConfig):
    """The FastAPI app and its engine thread (not started), ready for uvicorn; the engine process (with
    ``options.engine_process``, or several ranks) is started and ready.

    The app keeps the :class:`~dsinfer.llm.LLM` in ``app.state.llm``: close it after stopping the engine.
    """
    parallel = check_parallelism(options)
    llm = LLM(
        options.model, engine_config, parallel, load_format=options.load_format,
        engine_process=options.engine_process,
    )  # fmt: skip
    name = options.served_model_name or (Path(options.model).name if options.model else DEFAULT_SERVED_MODEL_NAME)
    metrics = ServerMetrics(name)
    engine = AsyncEngine(llm.engine, metrics, options.max_queue, options.request_timeout)
    variant = "v41" if llm.engine.model.config.model_type.startswith("deepseek_v41") else "v4"  # prompts as trained
    vision = getattr(llm.engine.model.config, "vision", None)
    settings = ServerSettings(
        name, options.api_key, llm.engine.max_model_len, chat_variant=variant, max_n=options.max_n,
        vocab_size=llm.engine.model.config.vocab_size, vision=vision, image_limits=options.image_limits,
    )  # fmt: skip
    app = build_app(engine, llm.tokenizer, settings)
    app.state.llm = llm
    return app, engine


def serve(options: ServeOptions, engine_config: EngineConfig) -> int:
    """Run until SIGTERM / Ctrl-C (exit status 0) or until an engine process dies (1, after /health has said 503)."""
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parallel = check_parallelism(options)
    if parallel.node_rank > 0:  # this host only runs ranks; the API process lives on host 0
        from dsinfer.parallel.ranked_engine import run_remote_ranks

        return run_remote_ranks(options.model, engine_config, parallel)
    app, engine = build_server(options, engine_config)
    freeze_heap()  # the process serves until it exits: full collections skip what start-up left alive
    engine.start()
    config = uvicorn.Config(
        app, host=options.host, port=options.port, log_level=options.log_level,
        timeout_graceful_shutdown=options.drain_timeout + BACKSTOP_SECONDS,
    )  # fmt: skip
    drain = Drain(engine, options.drain_timeout)
    server = _DrainingServer(config, drain)
    threading.Thread(target=_exit_when_engine_dies, args=(server, engine), name="dsinfer-watch", daemon=True).start()
    try:
        server.run()
    finally:
        drain.cancel()
        engine.stop()
        if not engine.thread.is_alive():  # a step stuck past the timeout keeps its tables until the process exits
            app.state.llm.close()
    failure = getattr(app.state.llm.engine, "failure", None)
    if failure is not None:
        print(f"dsinfer serve: error: {failure}", file=sys.stderr)
        return 1
    return 0


DEAD_ENGINE_LINGER_SECONDS = 1.0  # /health answers 503 this long before a server whose engine process died exits


def _exit_when_engine_dies(server: uvicorn.Server, engine: AsyncEngine) -> None:
    """An engine process (a rank) that dies leaves nothing to serve: say so on /health for a moment, then stop
    the server."""
    while not server.should_exit:
        if not engine.alive and getattr(engine.engine, "failure", None) is not None:
            time.sleep(DEAD_ENGINE_LINGER_SECONDS)
            server.should_exit = True
            return
        time.sleep(0.1)


class _DrainingServer(uvicorn.Server):
    """Starts the drain clock on SIGTERM / SIGINT; exits with status 0 once drained (uvicorn would re-raise
    SIGTERM after its graceful shutdown)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        self.drain.begin()
        captured = getattr(self, "_captured_signals", None)
        if sig == signal.SIGTERM and captured and captured[-1] == sig:
            captured.pop()
