"""Abort work for a client that left: wait on the ASGI ``receive`` channel for ``http.disconnect``.

The server posts a ``http.disconnect`` message the moment the connection closes; awaiting it (rather than
polling ``request.is_disconnected()``) lets the handler cancel the request at once, so the engine thread
receives the abort before its next step. Streaming responses get the same from Starlette, which cancels the
body iterator when the client goes; cancelling the iteration aborts every sequence of the request (any ``n``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request

T = TypeVar("T")


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the request body has been read already, so nothing else arrives)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(work: Awaitable[T], request: Request) -> T:
    """Await ``work``; if the client disconnects first, cancel it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # let the engine streams run their abort paths
        raise ClientDisconnect()
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
