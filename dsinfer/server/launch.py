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
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from dsinfer.chat.image_reader import ImageLimits
from dsinfer.chat.limits import DEFAULT_MAX_N
from dsinfer.config import EngineConfig
from dsinfer.cpu_threads import apply_cpu_threads, usable_cpus
from dsinfer.engine.gc_heap import freeze_heap
from dsinfer.hub import is_repo_id
from dsinfer.llm import LLM
from dsinfer.parallel.config import ParallelConfig
from dsinfer.plan_cli import log_serving_plan
from dsinfer.server import DEFAULT_SERVED_MODEL_NAME
from dsinfer.server.app import ServerSettings, build_app
from dsinfer.server.async_engine import AsyncEngine
from dsinfer.server.drain import BACKSTOP_SECONDS, Drain
from dsinfer.server.metrics import ServerMetrics
from dsinfer.server.request_guard import DEFAULT_MAX_REQUEST_BYTES

logger = logging.getLogger(__name__)


@dataclass
class ServeOptions:
    model: str | None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    load_format: str = "auto"  # 'dummy': the directory's config and tokenizer, random weights (dsinfer.models.dummy)
    api_key: str | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # the rank layout, checked when it is made
    request_timeout: float | None = None
    max_queue: int | None = None
    max_n: int = DEFAULT_MAX_N
    drain_timeout: float = 30.0
    log_level: str = "info"
    image_limits: ImageLimits | None = None  # V4.1 with a vision tower: images per request, bytes, pixels
    # One rank: step the engine in a process of its own (``dsinfer serve`` does unless --engine-in-process) rather
    # than in this process's engine thread, which embedding code and tests keep by default, as LLM does.
    engine_process: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # a larger body is a 413 before it is parsed
    require_model: bool = True  # False: a request without ``model`` is served by the served model (vLLM)
    cpu_threads: int | None = None  # CPU engines: torch threads (default: usable cores less one for HTTP)
    revision: str | None = None  # a Hugging Face repository id's branch, tag or commit
    download_dir: str | None = None  # the hub cache for a repository id (default: HF_HUB_CACHE)


def build_server(options: ServeOptions, engine_config: EngineConfig):
    """The FastAPI app and its engine thread (not started), ready for uvicorn; the engine process (with
    ``options.engine_process``, or several ranks) is started and ready.

    The app keeps the :class:`~dsinfer.llm.LLM` in ``app.state.llm``: close it after stopping the engine.
    """
    parallel = options.parallel
    llm = LLM(
        options.model, engine_config, parallel, load_format=options.load_format,
        engine_process=options.engine_process, revision=options.revision, download_dir=options.download_dir,
    )  # fmt: skip
    name = options.served_model_name or _default_served_name(options.model)
    metrics = ServerMetrics(name)
    engine = AsyncEngine(llm.engine, metrics, options.max_queue, options.request_timeout)
    variant = llm.engine.model.config.family  # prompts as trained
    vision = getattr(llm.engine.model.config, "vision", None)
    settings = ServerSettings(
        name, options.api_key, llm.engine.max_model_len, chat_variant=variant, max_n=options.max_n,
        vocab_size=llm.engine.model.config.vocab_size, vision=vision, image_limits=options.image_limits,
        max_request_bytes=options.max_request_bytes, require_model=options.require_model,
    )  # fmt: skip
    app = build_app(engine, llm.tokenizer, settings)
    app.state.llm = llm
    logger.info("%s", startup_summary(llm, options.model, name, engine_config))
    return app, engine


def startup_summary(llm: LLM, model: str | None, served_name: str, config: EngineConfig) -> str:
    """One line of what this server serves with: model, served name, device, dtype, weights in memory, the KV
    cache and how many full-length sequences it holds, and the kernels chosen for the device."""
    parts = [f"model {model or 'the embedded default'}", f"served as {served_name!r}", f"device {config.device}",
             f"dtype {config.dtype}"]  # fmt: skip
    if llm.model is not None:
        weights = sum(t.numel() * t.element_size() for t in [*llm.model.parameters(), *llm.model.buffers()])
        parts.append(f"weights {weights / 2**20:.1f} MiB in memory")
    runner = getattr(llm.engine, "runner", None)
    max_model_len = getattr(llm.engine, "max_model_len", None)
    if runner is not None and max_model_len:
        cache_tokens = runner.num_blocks * runner.block_tokens
        parts.append(f"KV cache {runner.num_blocks} blocks ({cache_tokens} tokens)")
        parts.append(f"{cache_tokens // max_model_len} sequences of {max_model_len} tokens fit")
    else:
        parts.append("weights and KV cache in the engine processes")
    if llm.model is not None:
        from dsinfer.ops.registry import resolve

        parameter = next(llm.model.parameters(), None)
        if parameter is not None:
            parts.append(f"kernels: {resolve(parameter.device, parameter.dtype).describe()}")
    return "serving " + ", ".join(parts)


def _default_served_name(model: str | None) -> str:
    """A repository id is served under its own name (``ORG/NAME``, as vLLM does), a directory under its name."""
    if model is None:
        return DEFAULT_SERVED_MODEL_NAME
    return model if is_repo_id(model) else Path(model).name


def serve(options: ServeOptions, engine_config: EngineConfig) -> int:
    """Run until SIGTERM / Ctrl-C (exit status 0) or until an engine process dies (1, after /health has said 503)."""
    logging.basicConfig(level=options.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parallel = options.parallel
    if parallel.node_rank > 0:  # this host only runs ranks; the API process lives on host 0
        from dsinfer.parallel.ranked_engine import run_remote_ranks

        return run_remote_ranks(options.model, engine_config, parallel)
    threads = apply_cpu_threads(options.cpu_threads, engine_config.device, reserved=1,
                                engine_elsewhere=options.engine_process or parallel.is_multi_rank)  # fmt: skip
    if threads is not None:
        logger.info("CPU threads: %d for the engine (usable cores: %d; --cpu-threads overrides)", threads,
                    usable_cpus())  # fmt: skip
    log_serving_plan(options.model, engine_config, parallel.world_size)
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
