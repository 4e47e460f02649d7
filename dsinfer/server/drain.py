"""Graceful shutdown: on SIGTERM stop accepting, let in-flight requests finish for ``--drain-timeout`` seconds,
then end the rest cleanly.

Ending them is the engine's job, not uvicorn's: uvicorn's own timeout cancels the handler tasks, which cuts a
stream mid-line. Here the engine thread aborts every request still running and hands each an error, so a
stream ends with an error event and ``data: [DONE]`` and a non-streaming request gets a 503; uvicorn's
timeout stays behind as a backstop a few seconds later.
"""

from __future__ import annotations

import logging
import threading

from dsinfer.server.async_engine import AsyncEngine

log = logging.getLogger("dsinfer.server")

BACKSTOP_SECONDS = 5.0  # uvicorn's graceful-shutdown timeout: this much after the drain deadline


class Drain:
    def __init__(self, engine: AsyncEngine, timeout: float) -> None:
        self.engine, self.timeout = engine, timeout
        self._timer: threading.Timer | None = None

    def begin(self) -> None:
        """Start the drain clock (idempotent: a second signal does not restart it)."""
        if self._timer is not None:
            return
        log.info("shutting down: in-flight requests have %.1f s to finish (--drain-timeout)", self.timeout)
        self._timer = threading.Timer(self.timeout, self._cut)
        self._timer.daemon = True
        self._timer.start()

    def _cut(self) -> None:
        log.warning("--drain-timeout (%.1f s) passed: ending the requests still in flight", self.timeout)
        message = f"the server is shutting down; the request was ended after --drain-timeout ({self.timeout} s)"
        self.engine.cut_all(message)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
