"""Server-sent events: one JSON event, a stream that ends with an error event when its request fails or the engine
stops, and the interleaving of several requests' streams (``n`` > 1 on the chat and completions endpoints)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from paged_backend.engine.engine_loop import EngineDeadError, RequestFailedError
from paged_backend.outputs import RequestOutput


def sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream that fails midway ends with an OpenAI error event and ``[DONE]``, its status line having gone
    already: 500 when a step failed under its request (the engine goes on), 503 when the engine stopped (a device
    failure, or the server shutting down)."""
    try:
        async for event in events:
            yield event
    except RequestFailedError as exc:
        yield error_event(500, str(exc), "internal_server_error")
    except EngineDeadError as exc:
        yield error_event(503, str(exc), "service_unavailable")


def error_event(status: int, message: str, type_: str) -> str:
    return sse({"error": {"message": message, "type": type_, "param": None, "code": status}}) + "data: [DONE]\n\n"


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come; closing this closes (and so aborts) them all."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()  # None: stream i ended

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
