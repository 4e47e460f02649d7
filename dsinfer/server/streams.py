"""Several engine streams as one: a batched ``/v1/completions`` request runs one engine request per prompt."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Yield ``(stream index, item)`` as items arrive from any stream; the first error ends all of them.

    Leaving the iteration early (disconnect, error, shutdown) cancels every stream, which aborts its request.
    """
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    arrivals: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                arrivals.put_nowait((index, item, None))
        except Exception as exc:  # handed to the consumer, which raises it
            arrivals.put_nowait((index, None, exc))
            return
        arrivals.put_nowait((index, None, _END))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, end = await arrivals.get()
            if end is _END:
                remaining -= 1
            elif end is not None:
                raise end
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def last_items(streams: list[AsyncIterator[T]]) -> list[T]:
    """The final item of every stream (a request's finished output), in stream order."""
    finals: list = [None] * len(streams)
    async for index, item in merged(streams):
        finals[index] = item
    return finals
