"""A handler that stops when its client disconnects (vLLM's ``with_cancellation``).

A streamed response learns of a disconnect when it writes; a handler that waits for a whole completion writes
nothing until the end, so without this it would keep generating (and keep its KV blocks) for nobody. The handler
races a task that waits for ``http.disconnect``; whichever ends first cancels the other, and a cancelled handler
aborts its requests on the way out.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from starlette.requests import Request

P = ParamSpec("P")
T = TypeVar("T")


async def listen_for_disconnect(request: Request) -> None:
    """Returns once the client has gone. Only called after the body has been read (FastAPI reads it before the
    handler runs), so every message left on the channel is the disconnect."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def with_cancellation(handler: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T | None]]:
    """``handler`` (which takes the request as ``request``), cancelled when its client disconnects; then nothing is
    sent (there is nobody to send it to), and the route returns None. A handler that returns a streaming response
    returns at once, and the response watches for the disconnect from there."""

    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T | None:
        request = kwargs["request"]
        if not isinstance(request, Request):
            raise TypeError(f"{handler.__name__} must take the request as the keyword argument `request`")
        handler_task: asyncio.Task[T] = asyncio.ensure_future(handler(*args, **kwargs))
        disconnect_task = asyncio.ensure_future(listen_for_disconnect(request))
        try:
            await asyncio.wait([handler_task, disconnect_task], return_when=asyncio.FIRST_COMPLETED)
        finally:  # this task itself cancelled (server shutting down): take both down with it
            for task in (handler_task, disconnect_task):
                task.cancel()
            await asyncio.gather(handler_task, disconnect_task, return_exceptions=True)
        if handler_task.cancelled():
            return None
        return handler_task.result()

    return wrapper
